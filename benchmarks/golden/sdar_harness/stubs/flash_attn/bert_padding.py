"""CPU stand-in for flash_attn.bert_padding (imported, never called, by SDAR inference).
Same semantics as flash-attn's helpers, written in plain PyTorch."""
import torch
import torch.nn.functional as F


def index_first_axis(input, indices):
    # input: [total, ...]; returns input[indices]
    return input[indices]


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states [B, S, ...], attention_mask [B, S] (1 = keep).
    Returns (hidden [nnz, ...], indices [nnz], cu_seqlens [B+1] int32, max_seqlen_in_batch, seqused [B] int32)."""
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return (index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch,
            used_seqlens_in_batch)


def pad_input(hidden_states, indices, batch, seqlen):
    """hidden_states [nnz, ...] -> [batch, seqlen, ...] with zeros elsewhere."""
    out = torch.zeros(batch * seqlen, *hidden_states.shape[1:],
                      device=hidden_states.device, dtype=hidden_states.dtype)
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
