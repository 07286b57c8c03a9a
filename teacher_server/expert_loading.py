"""Each rank reads only its own experts of a saved mixture-of-experts checkpoint, under expert
parallelism (teacher_server/parallel.py): the routed experts are almost all of such a model
(Qwen3-235B-A22B: 227B of its 235B parameters, 454 GB in bf16), so a rank that built the whole
model before keeping E / N of its experts could never load it.

The rest of the model (attention, norms, routers, shared experts, embeddings, the head) loads
through transformers as before, whole on each rank, and `parallel.apply_plan` splits it. For the
experts, while transformers builds the model:
- each experts module's per-expert parameters are registered with this rank's experts only (a
  module parameter registration hook narrows them, on the meta device where transformers builds);
- the checkpoint's expert keys are renamed (`key_mapping`) so that transformers reads none of
  them (it initialises the small local parameters instead);
then this module reads the rank's experts from the safetensors files (a slice of each file, by
safetensors' own reader) into those parameters, in transformers' layout.

The layout read is the published one that transformers converts at load (checked against its
loading in tests/test_expert_loading.py): one tensor per expert,
`{experts}.{e}.gate_proj/up_proj/down_proj.weight` (Qwen2/3-MoE, DeepSeek-V3, Kimi-K2) or
`.w1/.w3/.w2.weight` under `block_sparse_moe` (Mixtral), stacked into `gate_up_proj` [E, 2I, H]
([gate | up]) and `down_proj` [E, H, I]. A published FP8 checkpoint (transformers' fine-grained
FP8, 128 x 128 blocks: Qwen3-235B-A22B-FP8, DeepSeek-V3) stores a `.weight_scale_inv` beside each
e4m3 weight, one scale per tile, read the same way into transformers' FP8 experts
(`gate_up_proj_scale_inv` [E, 2I / 128, H / 128], `down_proj_scale_inv`), the bytes as stored;
the model must then load as stored (fp8.loaded_as_stored). Any other: `plan` returns None with the
reason, and the caller builds the whole model. Among them experts stored 3-D under the parameters'
own names (gpt-oss in bf16): transformers goes back to a renamed key's own name where the model
has that name, so it would read them whole; and other quantizations (MXFP4 blocks, per-tensor FP8).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# What the checkpoint's expert keys are renamed to, so that transformers reads none of them.
HIDDEN = ".routed_read_by_each_rank."  # nothing a conversion of transformers matches
# One tensor per expert: (gate, up, down) names, and where Mixtral keeps its experts.
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_CONTAINERS = ((".mlp.experts", ".mlp.experts"), (".mlp.experts", ".block_sparse_moe.experts"))


@dataclass
class _Source:
    """Where one experts module's parameters are in the checkpoint."""

    module: str  # the module's name in the model
    per_expert: tuple[str, str, str, str]  # (container, gate, up, down): key f"{container}.{e}.{name}.weight"
    scales: bool = False  # an FP8 checkpoint's: f"{container}.{e}.{name}.weight_scale_inv" beside each weight


@dataclass
class ExpertPlan:
    """This rank's experts, where each experts module's are in the checkpoint, and the files."""

    first: int
    count: int
    total: int
    classes: tuple[type, ...]
    sources: dict[str, _Source]
    files: dict[str, Path]  # checkpoint key -> its safetensors file

    def nbytes(self, model: torch.nn.Module) -> int:
        modules = dict(model.named_modules())
        return sum(p.numel() * p.element_size() for name in self.sources for p in modules[name].parameters(False))


def plan(spec: str, config, rank: int, size: int, total: int, trust_remote_code: bool) -> tuple[ExpertPlan | None, str]:
    """This rank's ExpertPlan for the saved model `spec`, or (None, why each rank must build the whole model)."""
    from transformers import AutoModelForCausalLM

    from teacher_server.moe import experts_modules

    directory = Path(spec)
    if not directory.is_dir():
        return None, "the model is not a local directory (download it and give its path)"
    if trust_remote_code:
        return None, "its code is the model's own (--trust-remote-code), whose experts' layout is its own"
    scales = False
    if getattr(config, "quantization_config", None):
        from teacher_server import fp8

        declared = fp8.checkpoint_quantization(config) or {}
        if declared.get("quant_method") != "fp8" or list(declared.get("weight_block_size") or ()) != [fp8.BLOCK] * 2:
            return None, "its config declares a quantization other than FP8 in 128 x 128 blocks"
        scales = True
    files, why = checkpoint_files(directory, config)
    if files is None:
        return None, why
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = {id(module): name for name, module in skeleton.named_modules()}
    modules = experts_modules(skeleton)
    if not modules:
        return None, "its experts are not transformers' experts modules"
    sources = {}
    for module in modules:
        source = _find(names[id(module)], module, files, total, scales)
        if isinstance(source, str):
            return None, source
        sources[source.module] = source
    count = total // size
    classes = {type(m) for m in modules}
    if scales:  # what transformers' FP8 loader builds in their place
        from transformers.integrations.finegrained_fp8 import FP8Experts

        classes.add(FP8Experts)
    return ExpertPlan(rank * count, count, total, tuple(classes), sources, files), ""


def checkpoint_files(directory: Path, config) -> tuple[dict[str, Path] | None, str]:
    """Each tensor's safetensors file in a model directory, found as transformers finds the
    weights (`model.safetensors` before an index: a stale index left beside it names files
    transformers does not read); or (None, why not)."""
    from safetensors import safe_open

    if getattr(config, "transformers_weights", None):
        return None, "its config names its weights file (transformers_weights)"
    single = directory / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), "pt") as f:
            return {key: single for key in f.keys()}, ""
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return None, "the directory has no safetensors checkpoint"
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        return None, f"{index.name} cannot be read ({e})"
    if not isinstance(weight_map, dict):
        return None, f"{index.name} has no weight_map"
    # Inside the directory as transformers checks it (its path, not where a link leads: a hub
    # cache's snapshot links each file to a blob elsewhere).
    inside = os.path.abspath(directory)
    files = {}
    for key, name in weight_map.items():
        path = os.path.abspath(os.path.join(directory, name)) if isinstance(name, str) else ""
        if not path.endswith(".safetensors") or os.path.commonpath([inside, path]) != inside:
            return None, f"{index.name} puts {key!r} in {name!r}, not a safetensors file inside the directory"
        files[key] = Path(path)
    return files, ""


def _find(name: str, module, files: dict[str, Path], total: int, scales: bool = False) -> _Source | str:
    """Where `module`'s experts are in the checkpoint (with `scales`, each weight's FP8 tile scales
    beside it), or why they cannot be read a rank at a time."""
    params = {p for p, _ in module.named_parameters(recurse=False)}
    if any(True for _ in module.named_buffers(recurse=False)):
        return f"{name} has buffers beside its experts' weights"
    stored = {key for key in files if key.startswith(name + ".")}
    if stored and {f"{name}.{p}" for p in params} <= stored:  # (an FP8 one's scales beside them)
        return f"{name}'s experts are stored 3-D, as transformers keeps them, which it reads whole"
    if params == {"gate_up_proj", "down_proj"} and module.has_gate and not module.is_transposed:
        for (model_part, stored_part) in _CONTAINERS:
            if not name.endswith(model_part):
                continue
            container = name[:-len(model_part)] + stored_part
            present = {key for key in files if key.startswith(container + ".")}  # one scan of the keys a container
            for gate, up, down in _PER_EXPERT_NAMES:
                suffixes = (".weight", ".weight_scale_inv") if scales else (".weight",)
                expected = {f"{container}.{e}.{p}{suffix}" for e in range(total) for p in (gate, up, down)
                            for suffix in suffixes}
                if present == expected:
                    return _Source(name, (container, gate, up, down), scales)
    if any(".weight_scale" in key or key.endswith(("_blocks", "_scales", ".scale")) for key in stored):
        return f"{name}'s experts are stored quantized"
    return f"{name}'s experts are stored in a layout this teacher does not read a rank at a time"


@contextlib.contextmanager
def local_experts(expert_plan: ExpertPlan):
    """While transformers builds the model: experts modules get this rank's experts only, and
    their checkpoint keys are renamed away (the key_mapping to pass to from_pretrained)."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    first, count, total = expert_plan.first, expert_plan.count, expert_plan.total

    def narrow(module, name, param):
        if isinstance(module, expert_plan.classes) and param is not None and param.dim() and param.shape[0] == total:
            return torch.nn.Parameter(param.detach().narrow(0, first, count), requires_grad=param.requires_grad)
        return None

    handle = register_module_parameter_registration_hook(narrow)
    try:
        yield {r"\.experts\.": HIDDEN}
    finally:
        handle.remove()


def loaded_as_planned(expert_plan: ExpertPlan, loading_info: dict) -> str:
    """"" when transformers' load under `local_experts` left exactly the planned experts to read
    here (missing: their parameters; unexpected: their renamed keys; nothing mismatched), else
    what it left otherwise (the renaming must not have kept any other weight from loading)."""
    missing = set(loading_info.get("missing_keys", ()))
    planned = {f"{name}.{param}{suffix}" for name, source in expert_plan.sources.items()
               for param in ("gate_up_proj", "down_proj") for suffix in (("", "_scale_inv") if source.scales else ("",))}
    others = sorted(key for key in loading_info.get("unexpected_keys", ()) if HIDDEN not in key)
    mismatched = loading_info.get("mismatched_keys") or ()
    if missing != planned:
        return f"weights left unloaded beside the experts: {sorted(missing ^ planned)[:4]}"
    if others:
        return f"checkpoint keys left unread: {others[:4]}"
    if mismatched:
        return f"weights whose shape differs from the checkpoint's: {sorted(map(str, mismatched))[:4]}"
    return ""


def read_experts(model: torch.nn.Module, expert_plan: ExpertPlan) -> None:
    """Reads this rank's experts from the checkpoint into the model built under `local_experts`,
    and marks each experts module with its range (parallel.ExpertShard keeps it as it is)."""
    from safetensors import safe_open

    from teacher_server.moe import ExpertRange

    first, count = expert_plan.first, expert_plan.count
    modules = dict(model.named_modules())
    with contextlib.ExitStack() as stack:
        opened: dict[Path, object] = {}

        def tensor(key: str) -> torch.Tensor:
            path = expert_plan.files[key]
            if path not in opened:
                opened[path] = stack.enter_context(safe_open(str(path), "pt"))
            return opened[path].get_tensor(key)

        for name, source in expert_plan.sources.items():
            module = modules[name]
            container, gate, up, down = source.per_expert
            with torch.no_grad():
                for j, e in enumerate(range(first, first + count)):
                    prefix = f"{container}.{e}."
                    for suffix in (".weight", ".weight_scale_inv") if source.scales else (".weight",):
                        param = "" if suffix == ".weight" else "_scale_inv"
                        _copy(getattr(module, "gate_up_proj" + param)[j],
                              torch.cat([tensor(prefix + gate + suffix), tensor(prefix + up + suffix)]),
                              prefix + gate + suffix)
                        _copy(getattr(module, "down_proj" + param)[j], tensor(prefix + down + suffix),
                              prefix + down + suffix)
            module.num_experts = count
            module.expert_range = ExpertRange(first, count, expert_plan.total)


def _copy(param: torch.Tensor, value: torch.Tensor, key: str) -> None:
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor {key}: shape {tuple(value.shape)}, the model's "
                         f"{tuple(param.shape)}: the checkpoint does not fit its config.json")
    if value.dtype != param.dtype and torch.float8_e4m3fn in (value.dtype, param.dtype):
        raise ValueError(f"checkpoint tensor {key}: {value.dtype}, the model's {param.dtype}: an FP8 checkpoint "
                         "must load as stored (e4m3 into e4m3)")
    param.copy_(value)
