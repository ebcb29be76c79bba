"""Quantised targets: fine-grained FP8 checkpoints as released (Qwen3-*-FP8, Qwen3-Next-*-FP8).

Such a checkpoint's ``config.json`` has ``quantization_config`` (``quant_method: fp8``, ``fmt:
e4m3``, ``weight_block_size: [128, 128]``, maybe ``modules_to_not_convert``), and each quantised
linear layer stores ``weight`` as float8_e4m3fn [N, K] with ``weight_scale_inv`` [ceil(N/128),
ceil(K/128)] (bf16 in the Qwen releases): the real weight of block (i, j) is ``weight[block] *
weight_scale_inv[i, j]``. transformers loads it through its fine-grained FP8 integration
(transformers 5.24, read in ``.venv``):

- ``quantizers/quantizer_finegrained_fp8.py`` l.31-58 ``validate_environment``: it needs
  ``accelerate`` (l.32); with no CUDA (or XPU) device visible it sets ``dequantize=True`` for a
  pre-quantised checkpoint (l.38-44), and on a GPU of compute capability below 8.9 too (l.48-58);
- with ``dequantize``, ``integrations/finegrained_fp8.py`` l.952 leaves every ``nn.Linear`` as
  it is and ``Fp8Dequantize`` (l.1095-1200) multiplies each weight by its block scales while
  loading, into the parameter's dtype: the model is an ordinary one (fp32 on our CPU);
- without it, the linear layers become ``FP8Linear`` (l.388-446: the weight stays float8, the
  matmul quantises the activations per token-group and returns the input's dtype, bf16) and
  ``FP8Experts`` for MoE experts, whose kernels come from the ``kernels`` package
  (``kernels>=0.18.2,<0.19``): ``kernels-community/finegrained-fp8`` (version 4) fetched from the
  hub, or its local cache, at the first forward (l.87-138; ``integrations/hub_kernels.py`` l.802).

What a worker does (:func:`load_kwargs`, :func:`check_fp8_kernels`): on CUDA it loads the
checkpoint as released (its own ``quantization_config``; float8 weights on the GPU, half the bytes
of bf16) and the captured states are bf16, like an unquantised target's; the kernels are loaded at
the worker's load, so a missing ``kernels`` package or an unreachable kernel repository is a
:class:`BadConfig` before any batch. On the CPU it asks for ``dequantize=True`` itself (transformers
only does so when no GPU is visible: a CPU worker on a GPU host would otherwise keep float8
weights that no CPU kernel multiplies) and runs the dequantised weights in fp32.
"""

from __future__ import annotations

import logging

import torch

from hsx.errors import BadConfig

log = logging.getLogger(__name__)

#: Compute capability from which transformers runs the FP8 matmuls instead of dequantising
#: (``quantizer_finegrained_fp8.py`` l.48-58).
FP8_MIN_CAPABILITY = (8, 9)


def is_fp8(info) -> bool:
    """True when ``info`` (:class:`hsx.models.ModelInfo`) is a fine-grained FP8 checkpoint."""
    return bool(info.quantization) and info.quantization.get("quant_method") == "fp8"


def fp8_mode(info, device: torch.device) -> str | None:
    """How the FP8 checkpoint ``info`` runs on ``device``; None when it is not one.

    ``fp8``: float8 weights, FP8 matmuls (CUDA, compute capability >= 8.9); ``dequantized-bf16``:
    transformers dequantises on an older GPU; ``dequantized-fp32``: our CPU path.
    """
    if not is_fp8(info):
        return None
    if device.type != "cuda":
        return "dequantized-fp32"
    return "fp8" if torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY else "dequantized-bf16"


def load_kwargs(info, device: torch.device, path: str) -> dict:
    """Extra ``from_pretrained`` arguments for the checkpoint ``info`` on ``device``: none, except
    ``quantization_config`` with ``dequantize=True`` for an FP8 checkpoint on the CPU (module
    docstring). The checkpoint's own skip list is passed with it: transformers overwrites the
    checkpoint's ``dequantize`` and ``modules_to_not_convert`` with the ones given
    (``quantizers/auto.py`` l.268-273, ``FineGrainedFP8Config.get_loading_attributes``).
    """
    if fp8_mode(info, device) != "dequantized-fp32":
        return {}
    from transformers import AutoConfig, FineGrainedFP8Config

    from hsx.models import hub_kwargs

    qc = getattr(AutoConfig.from_pretrained(path, **hub_kwargs(path)), "quantization_config", None) or {}
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    log.info("target %s is an FP8 checkpoint (%s): on the CPU its weights are dequantised to fp32 while loading",
             info.name, info.quantization)
    # only these two of the config passed are used; the rest is the checkpoint's (quantizers/auto.py l.268-273)
    return {"quantization_config": FineGrainedFP8Config(modules_to_not_convert=qc.get("modules_to_not_convert"),
                                                        dequantize=True)}


def check_fp8_kernels(info, device: torch.device) -> None:
    """On CUDA with FP8 matmuls (:func:`fp8_mode` ``fp8``), load transformers' FP8 kernels now,
    so that a worker that cannot run them fails at its load, not at its first batch.

    Raises:
        BadConfig: the ``kernels`` package is missing or of a version transformers does not take,
            or ``kernels-community/finegrained-fp8`` cannot be fetched from the hub or its cache:
            names the checkpoint, its quantisation, the cause and the fix.
    """
    mode = fp8_mode(info, device)
    if mode == "dequantized-bf16":
        major, minor = torch.cuda.get_device_capability(device)
        log.warning("target %s is an FP8 checkpoint, but this GPU's compute capability is %d.%d (< %d.%d): "
                    "transformers dequantises it to bf16 (twice the weights' bytes on the GPU)",
                    info.name, major, minor, *FP8_MIN_CAPABILITY)
    if mode != "fp8":
        return
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

        load_finegrained_fp8_kernel()
    except Exception as exc:  # ImportError from transformers; hub / OSError from kernels' download
        raise BadConfig(
            f"target {info.name}: its checkpoint is FP8 ({info.quantization}), and transformers' FP8 matmul kernels "
            f"cannot be loaded ({type(exc).__name__}: {str(exc)[:300]}). transformers runs FP8 weights on CUDA "
            "with the `kernels` package (>=0.18.2,<0.19) and the hub kernel kernels-community/finegrained-fp8 "
            "(transformers/integrations/finegrained_fp8.py l.87-138, hub_kernels.py l.802). Fix: `pip install "
            "'kernels>=0.18.2,<0.19'` and fetch the kernel once where the hub is reachable (into HF_HOME, then "
            "HF_HUB_OFFLINE=1), or use the bf16 release of the model") from None
