#!/usr/bin/env bash
# Mutation testing (mutmut 3.8) over the modules engines trust to find their bugs: the
# schema's rules, the test harness, the graph buffers and emulation, the config key
# mapping and the audit. Slow (tens of minutes per module on two cores): not in CI.
#
# Usage (repository root):  scripts/mutation.sh [module...]
#   modules: core testing buffers capture config audit (default: all)
# Each module runs in a throw-away copy of the working tree (tracked and untracked,
# not ignored, files: uncommitted tests count) under $MUTATION_DIR/<module>; mutmut's
# results stay there (results.txt; `mutmut show NAME` from that folder, see the last
# line of the output). Each mutant runs in a child forked from mutmut's process; the
# plugin scripts/mutmut_fresh_import.py makes that child import hybridmeta and the tests
# again, so the code that runs at import (class building) runs mutated too.
#
# Environment:
#   MUTMUT_VENV   venv holding mutmut 3.8.1, torch and the test dependencies, with
#                 hybridmeta NOT installed (the tests must import the mutated copy under
#                 mutants/src); default .venv-mut. Make one with
#                 python3.11 -m venv .venv-mut && .venv-mut/bin/pip install mutmut==3.8.1 \
#                     torch numpy triton hypothesis pytest safetensors
#   MUTATION_DIR  where the copies go (default /tmp/hybridmeta-mutation)
#   MUTATION_KEEP=1  reuse a module's previous copy and results, refreshing its src/ and
#                 tests/ from the working tree: mutmut reruns the mutants whose function
#                 changed and collects stats for the tests it has not seen; add
#                 MUTATION_ONLY to rerun others (e.g. the survivors, after new tests)
#   MUTATION_ONLY mutant names or globs to run (e.g. 'hybridmeta.core.x__build__mutmut_*'),
#                 or "survivors": those the last run ran and did not kill (survived, no
#                 tests, timeout, segfault; a "not checked" mutant of a stopped run is
#                 left out)
#   MUTATION_CHILDREN  parallel mutants (default 1: a shared machine)
#   MUTATION_TIMEOUT  mutmut's timeout_constant (default 20 s); a mutant is stopped after
#                 (its tests' time + this) * MUTATION_TIMEOUT_MULT * 2 CPU seconds. A
#                 module whose mutants can loop forever (audit: AST walks) runs for hours
#                 at the default; there 2 and 5 stop a looping mutant in about a minute
#   MUTATION_TIMEOUT_MULT  mutmut's timeout_multiplier (default 15)
#   MUTATION_PREPARE=1  only make each module's folder and stop (to run it on a bigger
#                 machine: `cd <folder> && TRITON_INTERPRET=1 HYPOTHESIS_PROFILE=ci \
#                 CUDA_VISIBLE_DEVICES= mutmut run --max-children N && mutmut results --all
#                 true > results.txt`; put that results.txt back in the folder here, and
#                 MUTATION_KEEP=1 MUTATION_ONLY=survivors reruns what it left)
set -euo pipefail

root=$(git rev-parse --show-toplevel)
venv=${MUTMUT_VENV:-$root/.venv-mut}
base=${MUTATION_DIR:-/tmp/hybridmeta-mutation}
children=${MUTATION_CHILDREN:-1}
modules=${*:-core testing buffers capture config audit}
[[ -x $venv/bin/mutmut ]] || { echo "no mutmut in $venv (set MUTMUT_VENV)" >&2; exit 2; }
if "$venv/bin/python" -c 'import hybridmeta' 2>/dev/null; then
  echo "$venv has hybridmeta installed: the tests would not import the mutants" >&2; exit 2
fi

# module -> "source paths|test selection" (space-separated each; missing files are dropped)
spec() {
  case $1 in
  core) echo "src/hybridmeta/core.py|tests/test_core.py tests/test_core_rules.py tests/test_core_extension.py tests/test_schema_extension.py tests/properties/test_metadata_evolve.py" ;;
  testing) echo "src/hybridmeta/testing|tests/testing" ;;
  buffers) echo "src/hybridmeta/graphs/buffers.py|tests/graphs/test_buffers.py tests/graphs/test_buffers_slot_rules.py tests/graphs/test_buffers_construction.py tests/graphs/test_buffers_values.py tests/graphs/test_draft_buckets.py tests/properties/test_graphs_refresh.py" ;;
  capture) echo "src/hybridmeta/graphs/capture.py|tests/graphs/test_capture.py tests/graphs/test_runner.py" ;;
  config) echo "src/hybridmeta/runtime/config.py|tests/runtime/test_config.py" ;;
  audit) echo "src/hybridmeta/audit.py|tests/test_audit.py tests/test_audit_literals.py tests/test_audit_resolution.py" ;;
  *) echo "unknown module '$1' (core testing buffers capture config audit)" >&2; return 2 ;;
  esac
}

# copy_tree DEST [PATH...]: the working tree's tracked and untracked (not ignored) files
copy_tree() {
  local dest=$1
  shift
  (cd "$root" && git ls-files -z -co --exclude-standard -- "$@" | tar --null -T - -cf -) | tar -xf - -C "$dest"
}
toml_list() { local out="" x; for x in "$@"; do [[ -e $root/$x ]] && out+="\"$x\", "; done; echo "[${out%, }]"; }

for m in $modules; do
  s=$(spec "$m")
  IFS=' ' read -r -a sources <<<"${s%%|*}"
  IFS=' ' read -r -a tests <<<"${s#*|}"
  dir=$base/$m
  if [[ ${MUTATION_KEEP:-0} != 1 || ! -d $dir/mutants ]]; then
    rm -rf "$dir"
    mkdir -p "$dir"
    copy_tree "$dir"
  else
    # refresh the copy's sources, tests and configuration (mutmut copies them into
    # mutants/ again, regenerates the mutants of changed functions and collects stats for
    # the tests it has not seen)
    rm -rf "$dir/src" "$dir/tests" "$dir/mutants/tests"
    copy_tree "$dir" src tests pyproject.toml
  fi
  cat >>"$dir/pyproject.toml" <<EOF

[tool.mutmut]
source_paths = $(toml_list "${sources[@]}")
pytest_add_cli_args_test_selection = $(toml_list "${tests[@]}")
also_copy = ["src", "tests", "stubs", "examples", "mutmut_fresh_import.py"]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "mutmut_fresh_import", "-q", "-x"]
# each mutant's child imports hybridmeta and the tests again (seconds at nice 19 on a
# loaded machine): mutmut's wall-clock limit, (the tests' time + this) * 15, must allow it
timeout_constant = ${MUTATION_TIMEOUT:-20}
timeout_multiplier = ${MUTATION_TIMEOUT_MULT:-15}
EOF
  cp "$root/scripts/mutmut_fresh_import.py" "$dir/"
  only=()
  if [[ ${MUTATION_ONLY:-} == survivors ]]; then
    [[ -s $dir/results.txt ]] || { echo "no previous results in $dir" >&2; exit 2; }
    mapfile -t only < <(awk -F': ' 'NF == 2 && $2 != "killed" && $2 != "not checked" {sub(/^ +/, "", $1); print $1}' "$dir/results.txt")
  elif [[ -n ${MUTATION_ONLY:-} ]]; then
    read -r -a only <<<"$MUTATION_ONLY"
  fi
  if [[ ${MUTATION_PREPARE:-0} == 1 ]]; then
    echo "prepared $m in $dir"
    continue
  fi
  echo "=== $m: ${sources[*]} <- ${tests[*]} ($dir)${only:+, ${#only[@]} mutant name(s)/glob(s)}"
  start=$SECONDS
  (cd "$dir" && TRITON_INTERPRET=1 HYPOTHESIS_PROFILE=ci nice -n 19 "$venv/bin/mutmut" run \
      --max-children "$children" "${only[@]}") >"$dir/run.log" 2>&1 \
    || { echo "mutmut failed for $m, see $dir/run.log" >&2; tail -c 2000 "$dir/run.log" >&2; continue; }
  [[ -s $dir/results.txt ]] && mv "$dir/results.txt" "$dir/results.prev.txt"
  (cd "$dir" && "$venv/bin/mutmut" results --all true) >"$dir/results.txt" 2>&1
  if [[ ${#only[@]} -gt 0 && -s $dir/results.prev.txt ]]; then
    # a partial rerun: the mutants it did not run keep their previous status (mutmut
    # forgets it when the sources or the configuration changed)
    awk -F': ' 'NR == FNR {if (NF == 2) prev[$1] = $2; next}
                NF == 2 && $2 == "not checked" && ($1 in prev) {print $1 ": " prev[$1]; kept++; next}
                {print}
                END {if (kept) printf "%d results carried over from the previous run\n", kept > "/dev/stderr"}' \
      "$dir/results.prev.txt" "$dir/results.txt" >"$dir/results.merged.txt"
    mv "$dir/results.merged.txt" "$dir/results.txt"
  fi
  echo "$(( (SECONDS - start) / 60 )) min; mutants by status:"
  awk -F': ' 'NF == 2 {n[$2]++; t++} END {for (k in n) printf "  %-12s %d\n", k, n[k]; printf "  %-12s %d\n", "total", t}' \
    "$dir/results.txt" | sort
  echo "not killed, by function:"
  awk -F': ' 'NF == 2 && $2 != "killed" {sub(/^ +/, "", $1); sub(/__mutmut_[0-9]+$/, "", $1); n[$1]++}
       END {for (k in n) printf "  %4d %s\n", n[k], k}' "$dir/results.txt" | sort -rn
  echo "inspect: cd $dir && $venv/bin/mutmut show NAME"
done
