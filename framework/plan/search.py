"""The search behind `parallel=auto`: every layout the world admits (ddp, fsdp both ways, tp, pp
with each schedule, cp, the hybrid degrees) times the memory knobs (activation checkpointing of
none, every k-th or every block; micro-batch against accumulation with the global batch kept; a
pipeline's micro-batch count), each predicted; the fastest whose predicted peak fits
`plan.memory_budget_mb` runs. Each combination is put through the config check's own checks of
what the search varies before it is priced (admit.py): a refused one is dropped and counted.

The knobs vary one copy of each layout's config in place (a deep copy per combination would cost
more than its prediction), so that a few hundred combinations take seconds.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from framework.config import CONF_DIR, ConfigError, resolve_device
from framework.config.model import meta_model, model_dims_of, model_spec, resolve_sequence_parallel
from framework.config.schema import group_schema
from framework.machine import local_ranks
from framework.parallel.dims import ParallelDims
from framework.parallel.pipeline import least_microbatches, stages_per_rank
from framework.plan.admit import Admission
from framework.plan.gpu import gpu_spec
from framework.plan.knobs import Knobs, knob_options
from framework.plan.predict import predict
from framework.plan.profile import Profile, machine_profile


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]  # what selects it on the command line
    cfg: DictConfig  # the run's config with this parallel group


def parallel_group(name: str, settings: dict[str, Any]) -> DictConfig:
    """The `parallel` group `python train.py parallel=NAME parallel.K=V ...` composes."""
    node = OmegaConf.load(CONF_DIR / "parallel" / f"{name}.yaml")
    node.pop("defaults", None)
    return OmegaConf.merge(OmegaConf.structured(group_schema("parallel", name)), node, settings)


def candidates(cfg: DictConfig, world: int) -> list[Candidate]:
    """Every layout `world` ranks admit for this model and batch: ddp, fsdp (full and grad-op),
    and for a model with a tensor-parallel plan tp, pp with each schedule, cp and the hybrid
    degrees dp x pp x tp; for a mixture of experts, expert parallel on fsdp at every degree that
    splits its experts and ranks, and on each hybrid at its largest (a rank's all-to-all bytes do
    not grow with ep; its experts' memory and gathers shrink).

    Every candidate trains the same job: the global batch stays data.batch_size x world (what
    ddp reads), so a layout with fewer data-parallel ranks takes a larger batch per rank."""
    options: list[tuple[str, dict[str, Any]]] = [("ddp", {}), ("fsdp", {}), ("fsdp", {"reshard_after_forward": False})]
    experts = _experts(cfg)
    options += [("fsdp", {"ep": ep}) for ep in _divisors(math.gcd(world, experts) if experts else 0)]
    if model_spec(cfg).tp_plan and not cfg.data.rank_batch_sizes:
        options += [("tp", {} if cfg.data.seq_len % world == 0 else {"sequence_parallel": False})]  # {}: auto
        options += [
            ("pp", {"schedule": s})
            for s in ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
        ]
        options += [("cp", {})]
        for dp, pp, tp in _factorizations(world):
            options.append(("hybrid", {"dp_shard": dp, "pp": pp, "tp": tp}))
            if experts and math.gcd(dp, experts) > 1:
                options.append(("hybrid", {"dp_shard": dp, "pp": pp, "tp": tp, "ep": math.gcd(dp, experts)}))
    out = []
    for name, settings in options:
        candidate = _candidate(cfg, world, name, settings)
        if candidate is not None:
            out.append(candidate)
    return out


def _candidate(cfg: DictConfig, world: int, name: str, settings: dict[str, Any]) -> Candidate | None:
    """The run's config with this parallel group (and the batch per rank that keeps the global
    batch), or None where the layout cannot run this model or batch."""
    parallel = parallel_group(name, settings)
    try:
        dims = ParallelDims.from_config(parallel, world, *model_dims_of(cfg))
    except ValueError:
        return None
    global_batch = cfg.data.batch_size * world
    if global_batch % dims.dp:
        return None
    trial = copy.deepcopy(cfg)
    OmegaConf.set_struct(trial, False)
    trial.data.batch_size = global_batch // dims.dp
    if dims.pp > 1:
        m = _microbatches(trial, parallel, dims.pp)
        if m is None:
            return None
        settings = settings | {"n_microbatches": m}
        parallel.n_microbatches = m
        parallel.pp = dims.pp  # parallel=pp's -1 (all ranks) as a degree: the knob search's bound reads it
    trial.parallel = parallel
    try:
        resolve_sequence_parallel(trial, dims.tp)  # auto -> what the model's plan runs (the note is validation's)
        if name != "ddp":
            dims.check_run(trial)
    except ValueError:
        return None
    flags = [f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()]
    if trial.data.batch_size != cfg.data.batch_size:
        flags.append(f"data.batch_size={trial.data.batch_size}")
    return Candidate((f"parallel={name}", *flags), trial)


def _experts(cfg: DictConfig) -> int:
    """The routed experts of each of the model's MoE layers (0: a dense model)."""
    from framework.plan.model import routed_shape

    moe, _ = routed_shape(meta_model(cfg), model_spec(cfg))
    return moe.experts if moe else 0


def _divisors(n: int) -> list[int]:
    """n's divisors above 1 (expert-parallel degrees; n = gcd(ranks, experts), 0 for a dense model)."""
    return [d for d in range(2, n + 1) if n % d == 0]


def _factorizations(world: int) -> list[tuple[int, int, int]]:
    """(dp, pp, tp) with dp x pp x tp = world and at least two of them above 1."""
    out = []
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            if world % (tp * pp) == 0:
                dp = world // (tp * pp)
                if sum(d > 1 for d in (dp, pp, tp)) >= 2:
                    out.append((dp, pp, tp))
    return out


def _microbatches(cfg: DictConfig, parallel: DictConfig, pp: int) -> int | None:
    """Micro-batches for a pipeline candidate: the group's default if the local batch allows it,
    else the fewest that the batch divides into and the schedule accepts."""
    local = cfg.data.batch_size * cfg.accumulation_steps
    least = least_microbatches(parallel.schedule, pp * stages_per_rank(parallel))
    ok = [m for m in range(1, local + 1) if local % m == 0 and m >= least]
    if not ok:
        return None
    return parallel.n_microbatches if parallel.n_microbatches in ok else ok[0]


# ----------------------------------------------------------------------------- the choice


def memory_budget_bytes(cfg: DictConfig, world: int) -> float:
    """Per-rank memory to fit in: `plan.memory_budget_mb`, else the device's memory (CPU: the
    machine's RAM shared by the ranks of one node)."""
    if cfg.plan.memory_budget_mb is not None:
        return cfg.plan.memory_budget_mb * 2**20
    if cfg.plan.get("gpu"):  # an unknown part: machine_profile names it
        return gpu_spec(cfg.plan.gpu).memory_gb * 1e9 if gpu_spec(cfg.plan.gpu) else 0.0
    device = resolve_device(cfg)
    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    local = local_ranks(world, cfg.plan.nodes, cfg.launch.nproc_per_node, device)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / local


@dataclass
class Ranked:
    candidate: Candidate
    prediction: dict[str, Any]
    fits: bool
    knobs: Knobs | None = None
    overrides: tuple[str, ...] = field(default=())  # the layout's and the knobs'

    def footprint(self) -> float:
        """What must fit the budget: the predicted peak, else the state and activations."""
        p = self.prediction
        return p["peak_bytes"] if p["peak_bytes"] is not None else p["total_bytes"]


FULL_SEARCH = 400  # combinations searched whole; past it, the knobs only on the likeliest layouts
SHORTLIST = 8


def rank(
    cfg: DictConfig, world: int, profile: Profile, budget: float, admission: Admission | None = None
) -> list[Ranked]:
    """Every layout and knob combination the config check accepts (`admission`: that check, its
    refusals counted) with its prediction: those that fit first, fastest first.

    A large world admits dozens of layouts: past FULL_SEARCH combinations each layout is first
    tried at its own knobs and at the most frugal ones (checkpoint every block, the smallest
    micro-batch), and only the SHORTLIST best of those get the whole knob grid."""
    facts = (meta_model(cfg), model_spec(cfg), model_dims_of(cfg))
    search = Search(cfg, world, profile, budget, facts, admission or Admission(world, facts[2]))
    grids = [(c, knob_options(cfg, c.cfg, search.facts[2][0])) for c in candidates(cfg, world)]
    if sum(len(g) for _, g in grids) > FULL_SEARCH:
        tried = [search.predicted(c, {g[0], _frugal(g)}) for c, g in grids]
        refused = (True, math.inf, math.inf)  # a layout both of whose first tries the config check refused
        best = sorted(range(len(grids)), key=lambda i: min(map(_order, tried[i]), default=refused))[:SHORTLIST]
        grids = [grids[i] if i in best else (grids[i][0], [r.knobs for r in tried[i]]) for i in range(len(grids))]
    out = [r for c, g in grids for r in search.predicted(c, g)]
    return sorted(out, key=_order)


def _order(r: Ranked) -> tuple:
    # models without a FLOP count (their candidates are all data-parallel: the same compute per
    # rank) rank by their communication time
    return (not r.fits, _seconds(r.prediction), r.footprint())


def _frugal(grid: list[Knobs]) -> Knobs:
    whole = lambda k: k.checkpoint_every == 1 and not k.selective  # noqa: E731
    return min(grid, key=lambda k: (-whole(k), k.batch_size, -(k.n_microbatches or 0)))


@dataclass
class Search:
    """What every prediction of one search shares."""

    cfg: DictConfig
    world: int
    profile: Profile
    budget: float
    facts: tuple  # (the meta model, its spec, (n_layer, n_head))
    admission: Admission  # the config check, asked of each combination before it is priced

    def predicted(self, c: Candidate, grid) -> list[Ranked]:
        """Layout `c` at each knob combination of `grid` the config check accepts, varied on one
        copy of its config."""
        trial, out = copy.deepcopy(c.cfg), []
        for knobs in grid:
            knobs.apply(trial)
            overrides = merged(c.overrides, knobs.overrides(c.cfg))
            if self.admission.refusal(trial, overrides) is not None:
                continue  # train.py would refuse it: never priced, never proposed
            p = predict(trial, self.world, self.profile, self.facts)
            if knobs.selective and p["memory"]["activation_bytes"] is None:
                continue  # what selective keeps is not forecast for this model (routed experts): not chosen blind
            r = Ranked(c, p, False, knobs, overrides)
            r.fits = r.footprint() <= self.budget
            out.append(r)
        return out


def merged(*groups) -> tuple[str, ...]:
    """Command-line overrides, a later one of a key replacing an earlier one (Hydra refuses a key
    given twice)."""
    out: dict[str, str] = {}
    for flag in (f for g in groups for f in g):
        out[flag.split("=", 1)[0]] = flag
    return tuple(out.values())


def _seconds(prediction: dict[str, Any]) -> float:
    for key in ("step_time_s", "comm_time_s"):
        if prediction[key] is not None:
            return prediction[key]
    return math.inf


def choose(
    cfg: DictConfig, world: int, measure: str = "probe", with_profile: bool = False, admission: Admission | None = None
) -> tuple:
    """(the combination parallel=auto runs, every one ranked, the budget in bytes[, the machine
    profile]); `admission` (given: read after) counts what the config check refused. Raises
    ConfigError naming plan.memory_budget_mb when none fits."""
    profile = machine_profile(cfg, world, measure)
    budget = memory_budget_bytes(cfg, world)
    admission = admission or Admission(world, model_dims_of(cfg))
    ranked = rank(cfg, world, profile, budget, admission)
    if not ranked:
        refused = admission.record()
        why = (
            f" (the config check refused {refused['refused']}: {refused['refused_example']})"
            if refused["refused"]
            else ""
        )
        raise ConfigError("parallel", f"parallel=auto: no layout runs {cfg.model._target_} on {world} ranks{why}")
    if not ranked[0].fits:
        smallest = min(ranked, key=Ranked.footprint)
        raise ConfigError(
            "plan.memory_budget_mb",
            f"no layout fits {budget / 2**20:.0f} MB per rank at {world} ranks; the smallest predicted "
            f"footprint is {smallest.footprint() / 2**20:.0f} MB ({smallest.prediction['layout']}: "
            f"{' '.join(smallest.overrides)}). Raise the budget, add ranks, or save memory "
            "(memory=checkpoint, a smaller data.batch_size)",
        )
    return (ranked[0], ranked, budget, profile) if with_profile else (ranked[0], ranked, budget)


@dataclass(frozen=True)
class AutoChoice:
    """What parallel=auto chose: the `parallel` group and memory knobs the workers run (`apply`
    sets them in the config), and the record of the choice and why, which travels beside the
    config (launch's Job) into summary.json `plan.auto`."""

    parallel: DictConfig
    knobs: Knobs
    record: dict[str, Any]

    def apply(self, cfg: DictConfig) -> None:
        """Put the chosen layout and knobs into `cfg` (in place: the config the workers run)."""
        cfg.parallel = self.parallel  # OmegaConf copies a node it is given
        self.knobs.apply(cfg)  # the same global batch, whatever the layout

    def line(self) -> str:
        """The one line the launcher prints."""
        r = self.record
        return f"parallel=auto: {r['layout']} ({' '.join(r['overrides'])}): {r['why']}"


def plan_auto(cfg: DictConfig, world: int, measure: str = "probe") -> AutoChoice:
    """parallel=auto: the layout, memory knobs and record of the fastest combination that fits.
    A pure function of the config (not written), the model's shapes and the machine."""
    admission = Admission(world, model_dims_of(cfg))
    best, ranked, budget = choose(cfg, world, measure, admission=admission)
    fitting = [r for r in ranked if r.fits]
    runner_up = (
        f"; next: {fitting[1].prediction['layout']} ({' '.join(fitting[1].overrides)})" if len(fitting) > 1 else ""
    )
    global_batch = cfg.data.batch_size * cfg.accumulation_steps * world
    why = (
        f"fastest predicted step of the {len(fitting)} of {len(ranked)} layouts and memory knobs that fit "
        f"{budget / 2**20:.0f} MB per rank, at a global batch of {global_batch} samples{runner_up}"
    )
    rows = [{"layout": r.prediction["layout"], "overrides": " ".join(r.overrides), "fits": r.fits,
             "peak_mb": r.footprint() / 2**20, "step_time_s": r.prediction["step_time_s"]}
            for r in ranked[:20]]  # fmt: skip
    record = {
        "layout": best.prediction["layout"],
        "overrides": list(best.overrides),
        "why": why,
        "budget_mb": budget / 2**20,
        "ranked": rows,
        "config_check": admission.record(),  # combinations train.py's check refused: dropped before pricing
    }
    return AutoChoice(best.candidate.cfg.parallel, best.knobs, record)
