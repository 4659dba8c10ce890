# Typing cases for Mamba2Metadata.evolve_from, checked by tests/typing/test_mypy_cases.py.
# A line ending in an "E:" comment (hash, E, colon, text) must get exactly one mypy report
# containing that text; every other line must get none.
import torch

from hybridmeta import ForwardMetadata, Mamba2Metadata, MixedMetadata, metadata

fwd = ForwardMetadata(
    query_start_loc=torch.zeros(2, dtype=torch.int32),
    mamba_cache_indices=torch.zeros(1, dtype=torch.int32),
)
mixed: MixedMetadata | None = None

ok = Mamba2Metadata.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=1, mixed=None)
reveal_type(ok)  # E: Revealed type is "hybridmeta.model.Mamba2Metadata"
ok2 = Mamba2Metadata.evolve_from(
    fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=1, mixed=mixed, has_mamba_track_mask=True
)

Mamba2Metadata.evolve_from(fwd, num_prefills=0, num_decodes=1, mixed=None)  # E: Missing named argument "num_prefill_tokens"
Mamba2Metadata.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=1)  # E: Missing named argument "mixed"
Mamba2Metadata.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=1, mixed=None, bogus=1)  # E: Unexpected keyword argument "bogus"
Mamba2Metadata.evolve_from(fwd, num_prefills="0", num_prefill_tokens=0, num_decodes=1, mixed=None)  # E: Argument "num_prefills" to "evolve_from" of "Mamba2Metadata" has incompatible type "str"; expected "int"
Mamba2Metadata.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=1, mixed=None, query_start_loc=3)  # E: Argument "query_start_loc" to "evolve_from" of "Mamba2Metadata" has incompatible type "int"; expected "Tensor"
Mamba2Metadata.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=1, mixed=fwd)  # E: Argument "mixed" to "evolve_from" of "Mamba2Metadata" has incompatible type "ForwardMetadata"; expected "MixedMetadata | None"
Mamba2Metadata.evolve_from(mixed, num_prefills=0, num_prefill_tokens=0, num_decodes=1, mixed=None)  # E: Argument 1 to "evolve_from" of "Mamba2Metadata" has incompatible type "MixedMetadata | None"; expected "ForwardMetadata"
Mamba2Metadata.evolve_from(source=fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=1, mixed=None)  # E: Unexpected keyword argument "source"
fwd.query_start_loc = torch.zeros(1)  # E: Property "query_start_loc" defined in "ForwardMetadata" is read-only


# A class derived from a derived class: its own evolve_from takes its own source, with no
# false [override] report on the class.
@metadata
class EngineMamba2(Mamba2Metadata):
    engine_step: int


eng = EngineMamba2.evolve_from(ok, engine_step=3)
reveal_type(eng)  # E: Revealed type is "tests.typing.cases.evolve_from.EngineMamba2"
EngineMamba2.evolve_from(fwd, engine_step=3)  # E: Argument 1 to "evolve_from" of "EngineMamba2" has incompatible type "ForwardMetadata"; expected "Mamba2Metadata"
EngineMamba2.evolve_from(ok)  # E: Missing named argument "engine_step"
