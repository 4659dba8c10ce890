# An engine's own metadata classes get the same checking as hybridmeta's.
import torch

from hybridmeta import metadata, tensor_field
from hybridmeta.core import BATCH, INDEX, Pad


@metadata
class EngineSource:
    slots: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(-1))
    flag: bool = False


@metadata
class EngineDerived(EngineSource):
    steps: int
    note: str | None


src = EngineSource(slots=torch.zeros(2, dtype=torch.int64))
d = EngineDerived.evolve_from(src, steps=1, note=None)
reveal_type(d.flag)  # E: Revealed type is "bool"
EngineDerived.evolve_from(src, steps=1)  # E: Missing named argument "note" for "evolve_from" of "EngineDerived"
EngineDerived.evolve_from(src, steps=1, note=None, flag="yes")  # E: Argument "flag" to "evolve_from" of "EngineDerived" has incompatible type "str"; expected "bool"
# A subclass instance type-checks as a source; evolve_from refuses it at run time (exact class).
EngineDerived.evolve_from(d, steps=1, note=None)
EngineSource.evolve_from(src)  # E: "type[EngineSource]" has no attribute "evolve_from"
