"""torch modules that stand in for a transformers MoE block (router, experts, shared expert: the whole
`mlp` of an MoE decoder layer) and hold no parameters of their own. ExpertBlock asks an expert tier for
its layer; ColibriBlock is the drop-in for PyTorch users, a colibri.MoELayer called in-process:

    from colibri.attention import ColibriBlock
    model.model.layers[3].mlp = ColibriBlock.from_file("packed/layer3.colibri.safetensors", device="cuda",
                                                       family=model.config.model_type)

Both take hidden states [B, S, H] and give what the family's block gives: [B, S, H], or for gpt-oss
(GptOssMLP returns its router scores too, which the decoder layer drops) ([B, S, H], None). Inference
only: nothing flows back to the hidden states' graph."""
import torch

# Families whose MoE block returns (hidden_states, router_scores) rather than hidden_states
# (transformers 5.25, models/<family>/modeling_<family>.py).
TUPLE_FAMILIES = {"gpt_oss"}


class _Block(torch.nn.Module):
    def __init__(self, family=None):
        super().__init__()
        self.returns_tuple = family in TUPLE_FAMILIES

    def forward(self, hidden_states):
        shape = hidden_states.shape
        # detach: DLPack refuses tensors that require grad, and no gradient reaches the experts anyway.
        x = hidden_states.detach().reshape(-1, shape[-1])
        if not x.is_contiguous():
            x = x.contiguous()
        out = self._experts(x).reshape(shape)
        return (out, None) if self.returns_tuple else out


class ExpertBlock(_Block):
    """Decoder layer `layer`'s MoE block, computed by `experts.forward(layer, x)` (colibri.attention.expert_tier)."""

    def __init__(self, experts, layer, family=None):
        super().__init__(family)
        self.experts, self.layer = experts, int(layer)

    def _experts(self, x):
        return self.experts.forward(self.layer, x)

    def extra_repr(self):
        return f"layer={self.layer}, experts={type(self.experts).__name__}"


class ColibriBlock(_Block):
    """A transformers MoE block replaced by a colibri.MoELayer called in-process through DLPack: on a GPU
    it enqueues the layer on torch's current stream, without a host synchronisation or an allocation
    outside torch's own (the output), so a forward can be captured in a CUDA graph and replayed.

    Parameters
    ----------
    layer : colibri.MoELayer
        The packed layer (on the device the hidden states will be on).
    family : str
        The model's model_type, for what the block returns (gpt_oss: a tuple)."""

    def __init__(self, layer, family=None):
        super().__init__(family)
        self.moe = layer

    @classmethod
    def from_file(cls, path, device="cpu", family=None):
        """The block of a packed *.colibri.safetensors file (`pack` writes one per MoE layer)."""
        from colibri.layer import MoELayer
        return cls(MoELayer.from_file(path, device=device), family)

    def _experts(self, x):
        return self.moe.forward(x)

    def extra_repr(self):
        return repr(self.moe)
