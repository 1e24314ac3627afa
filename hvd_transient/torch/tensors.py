"""A PyTorch training state as named tensors and JSON: what a checkpoint holds, and its restore.

The model's ``state_dict`` tensors are ``model/<key>``; the optimizer's per-parameter state tensors
``optimizer/<param index>/<key>``. What is not a tensor (the optimizer's parameter groups and
hyperparameters, non-tensor per-parameter values, a learning-rate scheduler's ``state_dict``) goes
into the checkpoint's JSON metadata under ``torch``, exactly (:mod:`hvd_transient.frontend.json_values`:
integer keys, tuples and infinities survive). Nothing is pickled.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Mapping

import numpy as np
import torch

from ckpt_service.errors import StructureMismatchError
from ckpt_service.plan import TensorSpec, TensorSpecs
from hvd_transient.frontend.json_values import UnsupportedValueError, decode, encode

MODEL, OPTIMIZER = "model/", "optimizer/"
#: the checkpoint metadata key of the state's JSON part
META_KEY = "torch"

_NUMPY_DTYPES: dict[torch.dtype, str] = {}


def numpy_dtype(dtype: torch.dtype) -> str:
    """The numpy dtype name of a torch dtype a checkpoint can hold (bfloat16 and the like cannot)."""
    if dtype not in _NUMPY_DTYPES:
        try:
            _NUMPY_DTYPES[dtype] = torch.empty((), dtype=dtype).numpy().dtype.name
        except TypeError as exc:
            raise TypeError(f"a checkpoint cannot hold torch {dtype} tensors (no numpy dtype); keep the "
                            "checkpointed state in float16, float32 or float64") from exc
    return _NUMPY_DTYPES[dtype]


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """Every tensor of the training state by its checkpoint name (the live tensors, not copies)."""
    named = {MODEL + key: value for key, value in model.state_dict().items()}
    if optimizer is not None:
        for index, entry in optimizer.state_dict()["state"].items():
            for key, value in entry.items():
                if torch.is_tensor(value):
                    named[f"{OPTIMIZER}{index}/{key}"] = value
    return named


def to_host(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """A host array of ``tensor``: an alias of a host tensor's memory, one copy of a device tensor."""
    array: np.ndarray[Any, Any] = tensor.detach().cpu().numpy()
    return array


def specs_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {name: TensorSpec(name, tuple(t.shape), numpy_dtype(t.dtype)) for name, t in tensors.items()}


class SpecCache:
    """The state's :class:`TensorSpecs`, made again only when a name, shape or dtype changed (an
    optimizer makes its per-parameter state at its first step): the save then finds its cached plan."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._specs: TensorSpecs | None = None

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> TensorSpecs:
        key = tuple((name, tuple(t.shape), t.dtype) for name, t in tensors.items())
        if self._specs is None or key != self._key:
            self._key, self._specs = key, TensorSpecs(specs_of(tensors))
        return self._specs


def scheduler_classes(scheduler: Any) -> list[Any]:
    """A scheduler's class and, for a composite one (``SequentialLR``, ``ChainedScheduler``), its children's."""
    return [type(scheduler).__qualname__, [scheduler_classes(c) for c in getattr(scheduler, "_schedulers", None) or []]]


def parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The model's names of the optimizer's parameters, group by group (``?``: not the model's)."""
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    return [[names.get(id(p), "?") for p in group["params"]] for group in optimizer.param_groups]


def parameter_shapes(optimizer: torch.optim.Optimizer) -> list[list[list[int]]]:
    """The shapes of the optimizer's parameters, group by group (those the model does not own included)."""
    return [[list(p.shape) for p in group["params"]] for group in optimizer.param_groups]


def json_part(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
              scheduler: Any | None) -> dict[str, Any]:
    """The state's part that is not tensors, as JSON values (checked: it must survive a round trip), with
    what a restore checks it against: the optimizer's class and parameters, the scheduler's classes."""
    part: dict[str, Any] = {}
    if optimizer is not None:
        sd = optimizer.state_dict()
        part["optimizer_class"] = type(optimizer).__qualname__
        part["parameters"] = parameter_names(model, optimizer)
        part["parameter_shapes"] = parameter_shapes(optimizer)
        part["param_groups"] = sd["param_groups"]
        part["scalars"] = {str(index): {k: v for k, v in entry.items() if not torch.is_tensor(v)}
                           for index, entry in sd["state"].items()}
    if scheduler is not None:
        part["scheduler_class"] = scheduler_classes(scheduler)
        part["scheduler"] = scheduler.state_dict()
    try:
        return dict(json.loads(json.dumps(encode(part), allow_nan=False)))
    except (UnsupportedValueError, ValueError) as exc:
        raise TypeError(f"the optimizer's or scheduler's state holds a value a checkpoint cannot carry: {exc} "
                        "(a tensor learning rate: give it as a float)") from exc


def check_fits(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any | None,
               tensors: Mapping[str, np.ndarray[Any, Any]], part: Mapping[str, Any]) -> None:
    """Raise :class:`~ckpt_service.errors.StructureMismatchError`, before anything is loaded, unless the
    checkpoint's model tensors are exactly the model's (names, shapes, dtypes), its optimizer the same kind
    over the same parameters in the same groups, and its scheduler of the same classes."""
    problems = []
    live = {MODEL + key: value for key, value in model.state_dict().items()}
    stored = {name: array for name, array in tensors.items() if name.startswith(MODEL)}
    for name in sorted(set(live) | set(stored)):
        if name not in stored:
            problems.append(f"{name}: in the model, not in the checkpoint")
        elif name not in live:
            problems.append(f"{name}: in the checkpoint, not in the model")
        elif (tuple(live[name].shape), numpy_dtype(live[name].dtype)) != (stored[name].shape, stored[name].dtype.name):
            problems.append(f"{name}: the model has {tuple(live[name].shape)} {numpy_dtype(live[name].dtype)}, the "
                            f"checkpoint {stored[name].shape} {stored[name].dtype.name}")
    if optimizer is not None:
        problems += _optimizer_problems(model, optimizer, tensors, part)
    if scheduler is not None:
        if "scheduler" not in part:
            problems.append("the checkpoint holds no scheduler state for the live scheduler")
        elif part.get("scheduler_class", scheduler_classes(scheduler)) != scheduler_classes(scheduler):
            problems.append(f"the scheduler is {scheduler_classes(scheduler)}, the checkpoint's "
                            f"{part['scheduler_class']}")
    if problems:
        raise StructureMismatchError("the checkpoint does not fit this model and optimizer (restore into the "
                                     "model, optimizer and scheduler it was saved from, or start in a new store): "
                                     + "; ".join(problems))


def _optimizer_problems(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        tensors: Mapping[str, np.ndarray[Any, Any]], part: Mapping[str, Any]) -> list[str]:
    if "param_groups" not in part:
        return ["the checkpoint holds no optimizer state for the live optimizer"]
    problems = []
    kind = part.get("optimizer_class")
    if kind is not None and kind != type(optimizer).__qualname__:
        problems.append(f"the optimizer is a {type(optimizer).__qualname__}, the checkpoint's a {kind}")
    saved_groups = [len(g["params"]) for g in part["param_groups"]]
    live_groups = [len(g["params"]) for g in optimizer.param_groups]
    if saved_groups != live_groups:
        problems.append(f"the optimizer's parameter groups hold {live_groups} parameters, the checkpoint's "
                        f"{saved_groups}")
    elif "parameters" in part and part["parameters"] != parameter_names(model, optimizer):
        problems.append(f"the optimizer's parameters are {parameter_names(model, optimizer)}, the checkpoint's "
                        f"{part['parameters']} (another order or grouping)")
    elif "parameter_shapes" in part and part["parameter_shapes"] != parameter_shapes(optimizer):
        problems.append(f"the optimizer's parameters have the shapes {parameter_shapes(optimizer)}, the "
                        f"checkpoint's {part['parameter_shapes']}")
    count = sum(live_groups)
    beyond = sorted({name for name in tensors if name.startswith(OPTIMIZER)
                     and not int(name[len(OPTIMIZER):].split("/", 1)[0]) < count})
    if beyond:
        problems.append(f"optimizer state for parameters the optimizer does not have: {beyond}")
    return problems


def load_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any | None,
               tensors: Mapping[str, np.ndarray[Any, Any]], part: Mapping[str, Any]) -> None:
    """Load a checkpoint's tensors and JSON part into the live model, optimizer and scheduler (checked
    first: a checkpoint that does not fit changes nothing)."""
    part = decode(dict(part))
    check_fits(model, optimizer, scheduler, tensors, part)
    if scheduler is not None:  # first, the one load that checks its own input: on a refusal nothing changed
        before = copy.deepcopy(scheduler.state_dict())
        try:
            scheduler.load_state_dict(dict(part["scheduler"]))
        except Exception as exc:  # noqa: BLE001 (the scheduler's own check, whatever it raises)
            scheduler.load_state_dict(before)
            raise StructureMismatchError(
                f"the checkpoint's scheduler state does not fit the scheduler: {exc!r}") from exc
    model_sd = {name[len(MODEL):]: torch.from_numpy(np.array(array)) for name, array in tensors.items()
                if name.startswith(MODEL)}
    model.load_state_dict(model_sd)
    if optimizer is not None:
        state: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in part.get("scalars", {}).items()}
        for name, array in tensors.items():
            if name.startswith(OPTIMIZER):
                index, key = name[len(OPTIMIZER):].split("/", 1)
                state.setdefault(int(index), {})[key] = torch.from_numpy(np.array(array))
        optimizer.load_state_dict({"state": state, "param_groups": [dict(g) for g in part["param_groups"]]})
