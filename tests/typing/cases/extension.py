# An engine extends the source metadata with its own fields and gets precise checking.
import torch

from hybridmeta import (
    BATCH,
    INDEX,
    Conventions,
    ForwardMetadata,
    Mamba2Metadata,
    Pad,
    RowOrder,
    metadata,
    tensor_field,
)


@metadata(extension=True, conventions=Conventions(row_order=RowOrder.DECODES_FIRST, null_slot=0))
class EngineForward(ForwardMetadata):
    seq_lens: torch.Tensor | None = tensor_field(
        rows=BATCH, dtypes=INDEX, pad=Pad.value(0), default=None
    )
    step: int = 0


@metadata
class EngineMamba2(Mamba2Metadata, EngineForward):
    tag: str


fwd = EngineForward(
    query_start_loc=torch.arange(3), mamba_cache_indices=torch.tensor([1, 2]), step=4
)
reveal_type(fwd.step)  # E: Revealed type is "int"
EngineForward(query_start_loc=torch.arange(3), mamba_cache_indices=torch.tensor([1, 2]), step="4")  # E: Argument "step" to "EngineForward" has incompatible type "str"; expected "int"
md = Mamba2Metadata.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=2, mixed=None)
reveal_type(md)  # E: Revealed type is "hybridmeta.model.Mamba2Metadata"
em = EngineMamba2.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=2, mixed=None, tag="t")
reveal_type(em.seq_lens)  # E: Revealed type is "torch._tensor.Tensor | None"
EngineMamba2.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=2, mixed=None)  # E: Missing named argument "tag" for "evolve_from" of "EngineMamba2"
EngineMamba2.evolve_from(md, num_prefills=0, num_prefill_tokens=0, num_decodes=2, mixed=None, tag="t")  # E: Argument 1 to "evolve_from" of "EngineMamba2" has incompatible type "Mamba2Metadata"; expected "EngineForward"
EngineMamba2.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=2, mixed=None, tag="t", step="x")  # E: Argument "step" to "evolve_from" of "EngineMamba2" has incompatible type "str"; expected "int"
