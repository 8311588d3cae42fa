"""The CPU backend: what runs a tower's calls on the CPU (``model.execution.Backend``), asked once per call.

It owns the ``cpu_kernels`` setting, the plan that setting resolves to (``machine.machine_plan`` for "auto"), the
linears packed for that plan (``packing``, under one lock for every tower so that concurrent first calls pack once)
and each call's workspace; its items run as for every backend (``model.execution.forwards_on``). A call in CPU
inference runs on the plan (``forward.CpuExecution``); any other runs the modules' own forward
(``modules_forward_required``). Calls on one tower from several threads are safe while they all run inference, or
all the modules' forward; mixing the two at once is not."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import ConfigError
from ...model.execution import Grid, ReferenceExecution, forwards_on, items_name
from ...model.tower import VisionTower
from .forward import CpuExecution
from .machine import machine_plan, native_kernels
from .packing import PACKING_LOCK, PackedLinear, block_need, linear_layers, pack_linears_, plan_needs, unpack_linears_
from .plan import CpuPlan
from .workspace import Workspace

CPU_KERNELS = ("auto", "reference")


def check_cpu_kernels(cpu_kernels: str | dict | CpuPlan) -> str | CpuPlan:
    """"auto" (the machine's measured plan), "reference" (the modules' own ops: addmm and SDPA, out of place), or a
    plan (a ``CpuPlan`` or its dict, as a run recorded it: the same kernels again)."""
    if isinstance(cpu_kernels, CpuPlan):
        return cpu_kernels
    if isinstance(cpu_kernels, dict):
        return CpuPlan.from_dict(cpu_kernels)
    if cpu_kernels not in CPU_KERNELS:
        raise ConfigError(f"cpu_kernels {cpu_kernels!r} is not one of {list(CPU_KERNELS)} or a CPU plan")
    return cpu_kernels


def use_cpu_kernels(tower: VisionTower, cpu_kernels: str | dict | CpuPlan, *, now: bool = True) -> VisionTower:
    """``tower``'s CPU inference calls on ``cpu_kernels`` from now on: its CPU backend told so, else one attached where
    its weights are on the CPU (prepared ``now`` or at its first CPU inference call) or on ``meta`` (not placed yet:
    most such towers are filled on the CPU); the setting is checked everywhere."""
    device = placement(tower)[0].type
    if isinstance(tower.backend, CpuBackend):
        tower.backend.set_cpu_kernels(tower, cpu_kernels)
    elif device == "cpu" and now:
        CpuBackend(cpu_kernels).attach(tower)
    elif device in ("cpu", "meta"):
        tower.use_backend(CpuBackend(cpu_kernels))
    else:
        check_cpu_kernels(cpu_kernels)
    return tower


def placement(tower: VisionTower) -> tuple[torch.device, torch.dtype]:
    weight = tower.patch_embed.proj.weight
    return weight.device, weight.dtype


def modules_forward_required(tower: VisionTower, pixel_values: torch.Tensor) -> bool:
    """Whether this call must run the modules' own forward: in compiled blocks or a compiled graph (inductor plans
    its own kernels, and dynamo traces no packed tensor), while autograd records or under autocast (the backend's
    in-place ops do neither), and while a forward hook would see a module run (the backend calls no module's
    forward, and a hook is there to see one)."""
    device = placement(tower)[0].type
    recording = torch.is_grad_enabled() and (pixel_values.requires_grad
                                             or any(p.requires_grad for p in tower.parameters()))
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    return tower.compiled or torch.compiler.is_compiling() or recording or autocast or hooked(tower)


def hooked(tower: VisionTower) -> bool:
    """Whether a forward hook would see a module of this tower run (its own, or a global one)."""
    hooks = nn.modules.module  # torch's own registry of global hooks (no public getter)
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks) or any(
        m._forward_hooks or m._forward_pre_hooks for m in tower.modules() if m is not tower)


@dataclass(frozen=True)
class Prepared:
    """A tower made ready for a plan: where its weights were, the plan, the layers packed for it, torch's threads."""

    placement: tuple[torch.device, torch.dtype]
    plan: CpuPlan
    packed: tuple[PackedLinear, ...]
    threads: int


class CpuBackend:
    """The CPU backend of one tower; ``cpu_kernels`` as ``check_cpu_kernels`` takes it. ``attach`` prepares now,
    ``VisionTower.use_backend`` at the first CPU inference call. It serves the first tower that calls it and refuses
    to prepare any other (its preparation is that tower's packed layers); where it packs nothing (off the CPU,
    "reference", compiled) any tower may run on it, e.g. ``nn.DataParallel``'s replicas, which share attributes."""

    def __init__(self, cpu_kernels: str | dict | CpuPlan = "auto") -> None:
        self.cpu_kernels = check_cpu_kernels(cpu_kernels)
        self.prepared: Prepared | None = None
        # The tower it serves: weak, so the backend never keeps its tower alive (it holds what it packed until
        # released).
        self.tower: weakref.ref | None = None
        # Until this backend has prepared or released its tower, the tower may hold layers packed by another (a deep
        # copy's, a former backend's): a release then unpacks whatever it finds.
        self.unaccounted = True
        self.binding = threading.Lock()  # not the packing lock: binding never waits for another tower's measuring

    def __deepcopy__(self, memo: dict) -> CpuBackend:
        return type(self)(self.cpu_kernels)  # a copied tower's layers are its own: the copy prepares them again

    def serves(self, tower: VisionTower) -> bool:
        """Whether this backend runs ``tower``: bound to it now if it runs no live tower yet."""
        if self.tower is not None and self.tower() is tower:
            return True  # the steady state: no lock taken
        with self.binding:
            served = None if self.tower is None else self.tower()
            if served is None:
                self.prepared, self.unaccounted = None, True
                self.tower = weakref.ref(tower)
            return served is None or served is tower

    def serve(self, tower: VisionTower) -> None:
        if not self.serves(tower):
            raise ConfigError("this CpuBackend already runs another tower: give each tower its own "
                              "(CpuBackend(cpu_kernels).attach(tower))")

    def set_cpu_kernels(self, tower: VisionTower, cpu_kernels: str | dict | CpuPlan) -> None:
        """Run on ``cpu_kernels`` from now on, prepared now where the weights are on the CPU; the layers stay packed
        where the new setting is the current one or the plan they are packed for (a run adopting its recorded one)."""
        wanted, previous = check_cpu_kernels(cpu_kernels), self.cpu_kernels
        current = self.current(tower)
        if wanted != self.cpu_kernels and (current is None or wanted != current.plan):
            self.release(tower)
        self.cpu_kernels = wanted
        try:
            self.prepare(tower)
        except Exception:  # a setting this CPU cannot run: the tower goes on as it ran before
            self.release(tower)
            self.cpu_kernels = previous
            self.prepare(tower)
            raise

    def attach(self, tower: VisionTower) -> CpuBackend:
        """This backend runs ``tower``'s calls from now on, prepared now where the weights are on the CPU (measuring
        what this machine's plan lacks, packing the linears the plan runs on oneDNN), else when they arrive there."""
        self.serve(tower)
        tower.use_backend(self)
        self.prepare(tower)
        return self

    def plan(self, tower: VisionTower) -> CpuPlan | None:
        """The plan the tower's inference calls run on now (None: the modules' own forward, or not prepared yet)."""
        current = self.current(tower)
        return None if current is None else current.plan

    # ------------------------------------------------------------------ execution.Backend

    def execution(self, tower: VisionTower, pixel_values: torch.Tensor, grids: list[Grid]
                  ) -> CpuExecution | ReferenceExecution:
        """The call's execution: on the plan in CPU inference, its workspace sized for the largest forward, else
        the modules' own forward (their plain weights given back first)."""
        forwards = self.forwards(tower)(pixel_values, grids)
        prepared = None if modules_forward_required(tower, pixel_values) else self.prepare(tower)
        if prepared is None:
            release = torch.compiler.disable(self.release) if torch.compiler.is_compiling() else self.release
            release(tower)
            return ReferenceExecution(tower.attention_backend(), forwards)
        cfg, (device, dtype) = tower.config, prepared.placement
        block = block_need(tower.blocks[0])
        rows = max(sum(t * h * w for t, h, w in pack) for _, pack in forwards)
        workspace = Workspace(rows, cfg.hidden_size, cfg.family.mlp, cfg.intermediate_size, dtype, device)
        native = native_kernels() if prepared.plan.elementwise_kernels(block) == "native" else None
        return CpuExecution(prepared.plan, workspace, prepared.plan.chunk_bytes(block), forwards, native)

    def release(self, tower: VisionTower) -> None:
        if not self.serves(tower):
            return  # nothing of that tower is this backend's (a backend attached to a second tower by hand)
        if self.prepared is None and not self.unaccounted:
            return
        if self.prepared is None and not any(isinstance(layer, PackedLinear) for _, layer in linear_layers(tower)):
            self.unaccounted = False  # nothing packed: no lock to wait for
            return
        with PACKING_LOCK, torch.inference_mode(False), torch.no_grad():
            unpack_linears_(tower)
            self.prepared, self.unaccounted = None, False

    def describe(self, tower: VisionTower) -> dict:
        current = self.current(tower)
        packed = sum(isinstance(layer, PackedLinear) for _, layer in linear_layers(tower))
        return {"items": items_name(self.forwards(tower)),
                "execution": "reference" if current is None else "cpu",
                "cpu_plan": None if current is None else current.plan.machine,
                "linear_kernels": {"addmm": len(linear_layers(tower)) - packed, "onednn": packed}}

    # ------------------------------------------------------------------ the decision's parts

    def forwards(self, tower: VisionTower):
        """How a call's items run: as for every backend (``model.execution.forwards_on``)."""
        return forwards_on(placement(tower)[0])

    def current(self, tower: VisionTower) -> Prepared | None:
        """The last preparation while it holds: the weights where it was made, every layer it packed still packed
        (a load or a conversion gives a packed layer back plain), and for "auto" the thread count it was made at (the
        machine's plan for another count is another plan)."""
        if not self.serves(tower):
            return None
        prepared = self.prepared
        if prepared is None or prepared.placement != placement(tower) or \
                not all(isinstance(layer, PackedLinear) for layer in prepared.packed) or \
                (self.cpu_kernels == "auto" and prepared.threads != torch.get_num_threads()):
            return None
        return prepared

    def prepare(self, tower: VisionTower) -> Prepared | None:
        """The tower ready for CPU inference on the plan: resolved and packed now unless it still is (None where
        every call runs the modules' own forward: "reference", off the CPU, on meta, compiled)."""
        device, _ = placement(tower)
        if self.cpu_kernels == "reference" or device.type != "cpu" or tower.compiled:
            self.release(tower)
            return None
        self.serve(tower)
        current = self.current(tower)
        if current is not None:
            return current  # the steady state: no lock taken
        with PACKING_LOCK, torch.inference_mode(False), torch.no_grad():
            current = self.current(tower)
            if current is None:
                plan = machine_plan(plan_needs(tower)) if self.cpu_kernels == "auto" else self.cpu_kernels
                if "native" in plan.elementwise.values() and native_kernels() is None:
                    raise ConfigError("the CPU plan runs the native elementwise kernels, which cannot be built here "
                                      "(the warning says why); cpu_kernels='auto' runs this machine's own plan")
                self.prepared = current = Prepared(placement(tower), plan, tuple(pack_linears_(tower, plan)),
                                                   torch.get_num_threads())
                self.unaccounted = False
            return current
