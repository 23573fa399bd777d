"""CPU stand-in for flash_attn.ops.triton.layer_norm.rms_norm_fn (pure PyTorch, forward only).

Semantics copied from flash-attn's Triton kernel _layer_norm_fwd_1pass_kernel with IS_RMS_NORM
(and its reference rms_norm_ref(upcast=True)):
  x32 = x.float() (+ residual.float() if given)
  rstd = 1 / sqrt(mean(x32**2, -1) + eps)
  y = (x32 * rstd) * weight.float() (+ bias.float())     # weight applied IN FLOAT32
  return y.to(x.dtype)                                     # single rounding at the end
Note the difference from HF Qwen3RMSNorm (weight * normed.to(input_dtype)): identical in float32,
different rounding in bf16/fp16.
SDAR calls: rms_norm_fn(hidden_states, weight=self.weight, bias=None, eps=self.variance_epsilon)
"""
import torch


def rms_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6,
                dropout_p=0.0, rowscale=None, prenorm=False, residual_in_fp32=False,
                return_dropout_mask=False, out=None, residual_out=None):
    if x1 is not None or weight1 is not None or bias1 is not None or dropout_p != 0.0 \
            or rowscale is not None or return_dropout_mask or out is not None or residual_out is not None:
        raise NotImplementedError("rms_norm_fn stub: only x, weight, bias, residual, eps, prenorm, residual_in_fp32")
    dtype = x.dtype
    xf = x.float()
    if residual is not None:
        xf = xf + residual.float()
    rstd = 1 / torch.sqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    y = xf * rstd * weight.float()
    if bias is not None:
        y = y + bias.float()
    y = y.to(dtype)
    if not prenorm:
        return y
    # flash-attn returns the pre-norm sum as residual_out (dtype: residual's, fp32 if residual_in_fp32, else x's)
    if residual is not None:
        res_dtype = residual.dtype
    elif residual_in_fp32:
        res_dtype = torch.float32
    else:
        res_dtype = dtype
    return y, xf.to(res_dtype)
