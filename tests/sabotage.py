"""Sabotage checks: does each test fail when the feature it names is broken?

The tree is copied once to a temporary folder (and byte-compiled there, with hash-checked .pyc
files, so that no process of any row compiles the untouched modules again). For every row of
SABOTAGES: replace one exact piece of text in one file of the copy (it must occur exactly once:
otherwise the row is BROKEN PATTERN, the code it aimed at has moved), run only the one test
(node id) that should catch it, with this Python and the copy on PYTHONPATH, and put the file
back. CAUGHT: they failed. MISSED: they passed with the feature broken. ERROR: pytest
could not run them (collection error, no such test). The table is printed and written to
docs/results/sabotage.md.

    make sabotage                      # every row
    make sabotage ARGS="--only clip"   # rows whose name contains "clip" (updates their rows of the table)
    make sabotage ARGS="--only 'clip|rollback'"  # ... either
    make sabotage ARGS="--baseline"    # first run each catching test on the untouched tree
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (sabotage, file, exact old text, new text, catching test): one row per feature; add yours.
SABOTAGES: list[tuple[str, str, str, str, str]] = [
    ("process groups left to interpreter shutdown", "framework/dist.py",
     "        dist.destroy_process_group()\n    gc.collect()", "        dist.destroy_process_group()",
     "tests/test_structure.py::test_a_run_frees_its_process_groups_while_the_interpreter_is_whole"),
    ("resume=auto ignored", "framework/checkpoint/resume.py",
     'if resume != "auto" and restart_count() == 0:', "if restart_count() == 0:",
     "tests/test_reliability.py::test_resume_auto_continues_from_the_newest_checkpoint_and_says_so"),
    ("compile branch skipped", "framework/parallel/apply.py",
     "    if cfg.compile:", "    if False:",
     "tests/test_performance.py::test_compile_trains_like_eager_in_one_process"),
    ("sequence parallel off", "framework/parallel/apply.py",
     'return bool(parallel_cfg.get("sequence_parallel", None)), parallel_cfg.get("loss_parallel", False)',
     'return False, parallel_cfg.get("loss_parallel", False)',
     "tests/test_strategies.py::test_sequence_and_loss_parallel_show_in_the_collectives"),
    ("loss parallel off", "framework/parallel/apply.py",
     'return bool(parallel_cfg.get("sequence_parallel", None)), parallel_cfg.get("loss_parallel", False)',
     'return bool(parallel_cfg.get("sequence_parallel", None)), False',
     "tests/test_strategies.py::test_sequence_and_loss_parallel_show_in_the_collectives"),
    ("pipeline schedule ignored (always 1F1B)", "framework/parallel/schedules.py",
     "getattr(pipelining, SINGLE_STAGE[name])", 'getattr(pipelining, SINGLE_STAGE["1F1B"])',
     "tests/test_strategies.py::test_pipeline_schedules_run_their_own_action_order"),
    ("grad_clip ignored", "framework/run/trainer.py",
     "parts, cfg.optim.grad_clip, cfg.nonfinite", "parts, 0.0, cfg.nonfinite",
     "tests/test_strategies.py::test_grad_clip_scales_the_update_in_a_run_designed_to_clip"),
    ("clipping never scales the gradients", "framework/run/step.py",
     'clip_grad_norm(grad_clip if grad_clip > 0 else float("inf"))', 'clip_grad_norm(float("inf"))',
     "tests/test_strategies.py::test_grad_clip_scales_the_update_in_a_run_designed_to_clip"),
    ("nonfinite=skip applies the step anyway", "framework/run/step.py",
     "if skip_nonfinite and not scaler.is_enabled() and not torch.isfinite(norm):", "if False:",
     "tests/test_reliability.py::test_a_skipped_step_leaves_parameters_and_optimizer_state_bitwise_unchanged"),
    ("nonfinite=skip steps Adam with zeroed gradients", "framework/run/step.py",
     "not torch.isfinite(norm):  # a sync, nonfinite=skip only\n        return norm, False",
     "not torch.isfinite(norm):\n        parts.optimizer.zero_grad(set_to_none=False); parts.optimizer.step(); return norm, False",
     "tests/test_reliability.py::test_a_skipped_step_leaves_parameters_and_optimizer_state_bitwise_unchanged"),
    ("loss scaler static", "framework/run/step.py",
     "        scaler.update()", "        pass",
     "tests/test_units.py::test_amp_loss_scale_halves_on_overflow_and_grows_after_the_interval"),
    ("activation-checkpoint wrapper skipped", "framework/levers/__init__.py",
     "lambda b: checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT)", "lambda b: b",
     "tests/test_units.py::test_activation_checkpointing_saves_less_and_keeps_gradients_identical"),
    ("DDP no_sync skipped under accumulation", "framework/parallel/apply.py",
     "grad_sync=lambda enabled: nullcontext() if enabled else ddp.no_sync(),",
     "grad_sync=lambda enabled: nullcontext(),",
     "tests/test_parity.py::test_no_sync_skips_communication_until_the_last_micro_batch"),
    ("token weighting of the loss removed (mean of rank means)", "framework/run/step.py",
     "scale = par.dp_size * par.cp_size / step_elements(cfg, info, parts, step_batches)",
     "scale = 1.0 / max(1, sum(loss_elements(b[1]) for _, b in step_batches))",
     "tests/test_data.py::test_token_losses_are_token_weighted_like_one_process_on_the_union_batch"),
    ("a data-parallel rank reads rank 0's samples", "framework/data/__init__.py",
     "    return distributed_sampler(order, dp_size, dp_rank, sizes, cfg.drop_last)",
     "    return distributed_sampler(order, dp_size, 0, sizes, cfg.drop_last)",
     "tests/test_data.py::test_the_default_sampler_gives_each_data_parallel_rank_its_own_samples[2]"),
    ("RNG restore skipped on resume", "framework/run/build.py",
     "        checkpoint.set_rng_state(rng, generators(parts))", "        pass",
     "tests/test_reliability.py::test_resume_across_an_epoch_boundary_is_bitwise[distributed]"),
    ("import cycle through a package __init__", "framework/levers/__init__.py",
     "from framework.modules import map_blocks",
     "from framework.modules import map_blocks\nfrom framework.config.schema import MemoryConfig  # noqa: F401",
     "tests/test_code_shape.py::test_framework_import_graph_has_no_cycles"),
    ("FSDP2 reshard_after_forward ignored", "framework/parallel/fsdp.py",
     'reshard = cfg.parallel.get("reshard_after_forward", True)', "reshard = True",
     "tests/test_measure.py::test_fsdp_reshard_knobs_show_in_the_all_gathers"),
    ("FSDP1 sharding_strategy ignored", "framework/parallel/fsdp.py",
     "strategy = ShardingStrategy[cfg.parallel.sharding_strategy]", 'strategy = ShardingStrategy["FULL_SHARD"]',
     "tests/test_measure.py::test_fsdp_reshard_knobs_show_in_the_all_gathers"),
    ("recomputation left out of the FLOP count", "models/gpt.py",
     "return model_flops + recomputed_blocks * (2 * rerun + 4 * D * seq_len)",
     "return model_flops + recomputed_blocks * (2 * rerun)",
     "tests/test_units.py::test_gpt_flops_per_token_match_flops_counted_on_a_real_training_step"),
    ("MFU over a peak that is not the probe's", "framework/measure/metrics.py",
     "        return cpu_peak_flops(dtype)", "        return cpu_peak_flops(dtype) * 0.9",
     "tests/test_performance.py::test_cpu_runs_report_mfu_from_a_cached_matmul_probe"),
    ("planner ignores the per-call latency of collectives", "framework/plan/timing.py",
     "    return calls * (profile.latency_of(op) + steps) + wire / bandwidth",
     "    return calls * steps + wire / bandwidth",
     "tests/test_plan.py::test_the_plan_command_ranks_every_layout_fastest_first"),
    ("views charged the bytes they only point at", "framework/plan/ops.py",
     "    if func.is_view or name in VIEWS:\n        return None\n", "",
     "tests/test_time_model.py::test_a_view_moves_no_bytes_and_math_bound_operators_are_priced_apart"),
    ("the backward priced on the forward's matmul grid", "framework/plan/timing.py",
     'kernels.matmul_s(m, k, n, "input_grad")', "kernels.matmul_s(m, k, n)",
     "tests/test_time_model.py::test_each_backward_matmul_reads_its_own_orientations_grid"),
    ("the in-situ factor left out of the arithmetic", "framework/plan/timing.py",
     "    scale = kernels.in_situ", "    scale = 1.0",
     "tests/test_time_model.py::test_the_in_situ_factor_scales_every_ranks_arithmetic"),
    ("every collective at the all-reduce's bandwidth", "framework/plan/profile.py",
     "return (self.op_bytes_per_s or {}).get(op.rpartition(\":\")[2], self.intra_bytes_per_s)",
     "return self.intra_bytes_per_s",
     "tests/test_time_model.py::test_each_collective_is_priced_at_its_own_bandwidth"),
    # the model contract (issue 20)
    ("FSDP units ignore the model's own blocks", "framework/parallel/apply.py",
     "apply_fsdp2(stage, blocks_of(stage, spec), mesh.dp_mesh, cfg)", "apply_fsdp2(stage, [], mesh.dp_mesh, cfg)",
     "tests/test_own_model.py::test_fsdp_wraps_each_of_the_models_own_blocks"),
    ("a plan naming a missing submodule accepted", "framework/contract.py",
     "        if not any(n.count(\".\") == pattern.count(\".\") and fnmatch.fnmatchcase(n, pattern) for n in names):",
     "        if False:",
     "tests/test_own_model.py::test_bad_model_declarations_are_one_line_before_any_worker[args2-model.tp_plan-names no submodule]"),
    ("Hugging Face outputs not unwrapped to their logits", "framework/contract.py",
     "    if hasattr(output, \"logits\"):\n        return output.logits\n    return output[0]", "    return output",
     "tests/test_hf.py::test_pretrained_loads_into_fsdp_shards_with_hf_first_loss"),
    ("pretrained weights kept whole on every rank while loading", "framework/hf.py",
     "        del full  # one full-size tensor at a time", "        loaded.add(full)",
     "tests/test_hf.py::test_loading_holds_one_full_size_tensor_at_a_time"),
    # the forkserver and the time model
    ("workers keep the forkserver's environment", "framework/machine.py",
     "    os.environ.clear()\n    os.environ.update(env | worker)\n", "",
     "tests/test_structure.py::test_workers_see_the_callers_environment_as_it_is_at_each_launch"),
    ("the launcher does not wait for the forkserver at exit", "framework/machine.py",
     "        atexit.register(stop)", "        pass",
     "tests/test_structure.py::test_the_peak_read_from_outside_includes_the_forked_workers"),
    ("the op trace splits norms and residual adds under tensor parallel", "framework/plan/ops.py",
     "sharded = style is not None or any(n in planned_parents for n in inside)", "sharded = True",
     "tests/test_plan.py::test_the_trace_places_each_operator_where_tensor_parallel_splits_it"),
    ("tied copies' gradients not summed", "framework/parallel/apply.py",
     "    if ties is not None and ties.holders:", "    if False:",
     "tests/test_llama.py::test_tied_llama_parity_across_strategies[pp]"),
    ("step folders ordered as strings", "framework/checkpoint/store.py",
     "sorted(names, key=step_of)", "sorted(names)",
     "tests/test_seams.py::test_checkpoints_are_ordered_by_step_past_a_million_and_pruning_keeps_the_newest"),
    ("evaluation under cp not split", "framework/callbacks/evaluation.py",
     "    inputs, kwargs, target = par.split_batch(inputs, target)", "    kwargs = {}",
     "tests/test_context.py::test_evaluation_under_cp_runs_each_ranks_part_of_the_sequence_through_the_ring"),
    ("the ring ignores the sliding window", "framework/parallel/ring_mask.py",
     "        mask = mask & (gap < rule.window)", "        pass",
     "tests/test_ring_mask.py::test_ring_attention_within_a_window_and_documents_equals_full_masked_attention"),
    ("the ring ignores packed documents", "framework/parallel/ring_mask.py",
     "        mask = mask & (qdoc[:, None, :, None] == kdoc[:, None, None, :])", "        pass",
     "tests/test_ring_mask.py::test_ring_attention_within_a_window_and_documents_equals_full_masked_attention"),
    # mixture of experts (issue 40) and LoRA under tensor parallel (issue 38)
    ("expert-parallel gradients not scaled by 1/ep", "framework/parallel/expert.py",
     "GradScale.apply(w, 1.0 / self.size)", "GradScale.apply(w, 1.0)",
     "tests/test_moe.py::test_expert_parallel_trains_as_one_process"),
    ("a Mixtral's experts stacked out of order", "framework/hf.py",
     "            slices[ours.index] = full", "            slices[ours.count - 1 - ours.index] = full",
     "tests/test_moe.py::test_a_mixtral_loads_with_transformers_loss_and_goes_back_bitwise"),
    # model=hf mixtures of experts (issue 67)
    ("a Hugging Face router's bias (a buffer) left unloaded", "framework/hf.py",
     "    targets = {canonical_name(n): b for n, b in module.named_buffers()} | params", "    targets = params",
     "tests/test_hf_moe.py::test_a_moe_folder_loads_and_evaluates_as_transformers_does[deepseek_v3]"),
    ("a grouped matmul on meta counted as nothing", "framework/measure/flops.py",
     "        return torch.mm(a, b[0])", "        return a.new_empty(a.shape[0], b.shape[-1])",
     "tests/test_hf_moe.py::test_a_float32_grouped_matmul_on_meta_counts_as_its_loop_of_matmuls"),
    ("an all-to-all counted by what it receives too", "framework/measure/comm.py",
     "        return _nbytes(args[1])", "        return max(_nbytes(args[0]), _nbytes(args[1]))",
     "tests/test_moe.py::test_expert_parallel_trains_as_one_process"),
    ("routing counted on every tensor-parallel rank", "framework/callbacks/model.py",
     "self.counted = float(mesh is None or mesh.tp_rank == 0 or split)", "self.counted = 1.0",
     "tests/test_moe.py::test_expert_parallel_composes_with_fsdp_hsdp_tp_pipelines_and_accumulation"),
    ("routing counted once over tp under sequence parallel (each tp rank routes its own tokens)",
     "framework/callbacks/model.py", "self.counted = float(mesh is None or mesh.tp_rank == 0 or split)",
     "self.counted = float(mesh is None or mesh.tp_rank == 0)",
     "tests/test_moe.py::test_sequence_parallel_and_context_parallel_route_every_token_once_as_one_process"),
    ("routed layers' gradients not summed over tp under sequence parallel", "framework/parallel/routed.py",
     '        sum_over_tp(routed_parameters(stages, blocks or ""), group)', "        pass",
     "tests/test_moe.py::test_sequence_parallel_and_context_parallel_route_every_token_once_as_one_process"),
    ("a tp rank's auxiliary loss weighs its whole sequence's under sequence parallel", "framework/callbacks/model.py",
     "self.token_share = 1.0 / mesh.dims.tp if split else 1.0", "self.token_share = 1.0",
     "tests/test_moe.py::test_sequence_parallel_and_context_parallel_route_every_token_once_as_one_process"),
    ("a pipeline's shape-inference forward counted in the first step's routing", "framework/parallel/schedules.py",
     "    for stage in stages:\n        forget_inference_counts(stage)", "    for stage in stages:\n        pass",
     "tests/test_moe.py::test_expert_parallel_composes_with_fsdp_hsdp_tp_pipelines_and_accumulation"),
    ("the planner's experts not split by ep", "framework/plan/model.py",
     "fsdp_rows(local[0] // layout.ep, layout.expert_shard)", "fsdp_rows(local[0], layout.expert_shard)",
     "tests/test_moe.py::test_the_planner_prices_expert_parallel_and_auto_chooses_it_where_only_it_fits"),
    ("parallel=auto never tries expert parallel on fsdp", "framework/plan/search.py",
     '    options += [("fsdp", {"ep": ep})', '    options += [] and [("fsdp", {"ep": ep})',
     "tests/test_moe.py::test_the_planner_prices_expert_parallel_and_auto_chooses_it_where_only_it_fits"),
    ("LoRA layers given the plain tensor-parallel styles", "framework/parallel/tensor.py",
     "        if isinstance(model.get_submodule(path), LoRALinear):", "        if False:",
     "tests/test_finetune.py::test_lora_under_ddp_pp_and_tp_equals_one_process[tp]"),
    # callbacks, the figure registry and the model's step protocol (issue 51)
    ("a routed layer's f never follows the step's loads", "models/moe.py",
     "        self.balance_share.copy_(torch.where(", "        (torch.where(",
     "tests/test_moe.py::test_load_imbalance_and_bias_balancing_follow_a_hand_count"),
    ("the step protocol's counts combined by max over ranks, not summed", "framework/callbacks/model.py",
     '"width": shape["rows"] * width, "log": False,', '"width": shape["rows"] * width, "log": False, "reduce": "max",',
     "tests/test_moe.py::test_the_default_balance_trains_as_one_process_under_ddp_fsdp_ep_and_pp"),
    ("a callback's state left out of the checkpoint", "framework/run/trainer.py",
     '"callbacks": self.callbacks.state_dict()', '"callbacks": {}',
     "tests/test_callbacks.py::test_a_users_callback_sees_every_step_adds_a_figure_stops_the_run_and_resumes[fsdp]"),
    ("the loop's stop and save flags read before the callbacks' on_step_end", "framework/run/trainer.py",
     '        theirs = hooks.gather("on_step_end", step)  # their requests so far ride the all-reduce with them\n',
     "        theirs = {}\n",
     "tests/test_callbacks.py::test_a_stop_asked_on_one_rank_before_the_all_reduce_stops_every_rank_at_the_settle"),
    ("a rollback that reads on from where the data was, not from its checkpoint's place", "framework/run/trainer.py",
     "epoch, samples = req.data_at or (back.data_position[0], back.data_position[1] + req.skip_samples)",
     "epoch, samples = req.data_at or (self.parts.data.epoch, self.parts.data.samples)",
     "tests/test_callbacks.py::test_a_callback_saves_skips_an_update_and_rolls_back"),
    ("amp's loss scale left out of a pipeline's loss (its gradients unscaled by a scale never applied)",
     "framework/run/step.py", "weight if amp is None else weight * amp", "weight",
     "tests/test_matrix.py::test_covering_subset[gpt|pp|precision=amp]"),
    ("a pipeline's loss a mean per micro-batch (a padded micro-batch's tokens weigh more)", "framework/loss.py",
     'return cross_entropy(logits, target, reduction="sum") * self.weight',
     "return cross_entropy(logits, target) * self.weight * target.numel()",
     "tests/test_matrix.py::test_covering_subset[gpt|pp|data=hf streamed]"),
    ("frozen norms trainable under sequence parallel (torch's SequenceParallel re-registers them)",
     "framework/parallel/tensor.py", "            param.requires_grad_(False)", "            pass",
     "tests/test_matrix.py::test_covering_subset[gpt|tp(sequence_parallel=true)|peft=lora]"),
    # the matrix under its noise-floor rule (tests/matrix.py FLOOR_MULTIPLE): the issue's own cell
    ("BatchNorm's statistics each rank's own (sync_batchnorm ignored)", "framework/parallel/apply.py",
     'if not cfg.parallel.get("sync_batchnorm", True) or', "if True or",
     "tests/test_matrix.py::test_covering_subset[resnet|fsdp(version=1,reshard_after_forward=false)|memory=checkpoint]"),
    ("a pipeline's schedule kept for a step of another batch or length", "framework/parallel/pipeline.py",
     "            self.schedule = self.rebuild()", "            pass",
     "tests/test_pipeline_schedules.py::test_a_pipeline_and_context_parallel_follow_a_batch_and_a_length_ramp_as_one_process"),
    ("compiled blocks donate their buffers under a zero-bubble schedule", "framework/levers/__init__.py",
     "torch._functorch.config.donated_buffer = not splits", "torch._functorch.config.donated_buffer = True",
     "tests/test_pipeline_schedules.py::test_compiled_block_splits_its_backward"),
    ("Inductor's in-place buffers under a zero-bubble schedule (the weight pass reads them again)",
     "framework/levers/__init__.py", "torch._inductor.config.inplace_buffers = not splits",
     "torch._inductor.config.inplace_buffers = True",
     "tests/test_matrix.py::test_covering_subset[llama(tie_embeddings=true)|pp(schedule=ZBVZeroBubble)|compile=true]"),
]  # fmt: skip

IGNORE = shutil.ignore_patterns(".git", ".venv", "outputs", "multirun", "wandb", "__pycache__", ".pytest_cache",
                                ".ruff_cache", "*.egg-info", ".whl")  # fmt: skip


def pytest_command(test: str) -> list[str]:
    # -m "slow or not slow": a catching test may be marked slow; -x: the first failure is enough
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow", test]


def run_tests(tree: Path, test: str, timeout: float) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "WANDB_MODE": "offline", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("HYDRADIST_FAULT", None)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(pytest_command(test), cwd=tree, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        rc, out = -1, "timed out"
    return rc, time.monotonic() - t0, out


def copy_tree(tmp: str) -> Path:
    """One copy of the tree for every row, byte-compiled: checked-hash .pyc files stay valid
    while their source is untouched and are ignored (recompiled in memory) for the one file a
    row changes, so a sabotage never runs stale bytecode."""
    tree = Path(tmp) / "tree"
    shutil.copytree(ROOT, tree, ignore=IGNORE)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "--invalidation-mode", "checked-hash",
                    str(tree / "framework"), str(tree / "models"), str(tree / "tests")], check=False)  # fmt: skip
    return tree


def apply(tree: Path, file: str, old: str, new: str) -> str | None:
    """Sabotage `file` in `tree`; its original text (to put back), or None when `old` does not
    occur exactly once."""
    path = tree / file
    text = path.read_text() if path.exists() else ""
    if text.count(old) != 1:
        return None
    path.write_text(text.replace(old, new))
    return text


def check(row: tuple[str, str, str, str, str], tree: Path, timeout: float) -> dict:
    name, file, old, new, test = row
    original = apply(tree, file, old, new)
    if original is None:
        return {"name": name, "file": file, "test": test, "result": "BROKEN PATTERN", "seconds": 0.0}
    try:
        rc, seconds, out = run_tests(tree, test, timeout)
    finally:
        (tree / file).write_text(original)
    result = {0: "MISSED", 1: "CAUGHT"}.get(rc, f"ERROR (pytest exit {rc})")
    if result != "CAUGHT":
        print(out[-3000:], file=sys.stderr)
    return {"name": name, "file": file, "test": test, "result": result, "seconds": seconds}


def baseline(rows: list, timeout: float) -> list[str]:
    """Each catching test on the untouched tree: it must pass, or a CAUGHT would mean nothing."""
    failing = []
    for test in dict.fromkeys(r[4] for r in rows):
        rc, seconds, out = run_tests(ROOT, test, timeout)
        print(f"baseline {'ok  ' if rc == 0 else 'FAIL'} {seconds:6.1f}s {test}", flush=True)
        if rc != 0:
            failing.append(test)
            print(out[-3000:], file=sys.stderr)
    return failing


def table(results: list[dict], command: str, total_s: float) -> str:
    lines = [
        "# Sabotage checks",
        "",
        "Each row breaks one feature with a one-line edit in a temporary copy of the tree and runs the test",
        "that should catch it (`tests/sabotage.py`; CAUGHT: the test failed).",
        "",
        f"Command: {command}  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}; {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"the last invocation took {total_s / 60:.1f} min (its rows' tests: {sum(r['seconds'] for r in results) / 60:.1f} min); "
        f"load average at the end {os.getloadavg()[0]:.1f} (other work shares the cores)",
        "",
        "| sabotage | file | catching test | result | seconds |",
        "| --- | --- | --- | --- | ---: |",
    ]
    for r in results:
        lines.append(f"| {r['name']} | `{r['file']}` | `{r['test']}` | {r['result']} | {r['seconds']:.0f} |")
    lines += ["", "Each row's command, in the sabotaged copy: `PYTHONPATH=<copy> python -m pytest -x -q -p no:cacheprovider "
              "-m 'slow or not slow' <catching test>`", ""]  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="rows whose sabotage name contains this text (or one of A|B|...)")
    parser.add_argument("--baseline", action="store_true", help="first run every catching test untouched")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per catching test")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "sabotage.md"))
    args = parser.parse_args()
    wanted = args.only.lower().split("|")
    rows = [r for r in SABOTAGES if any(w in r[0].lower() for w in wanted)]
    start = time.monotonic()
    if args.baseline and baseline(rows, args.timeout):
        print("some catching tests fail on the untouched tree: fix them first", file=sys.stderr)
        return 1
    results = []
    with tempfile.TemporaryDirectory(prefix="sabotage-") as tmp:
        tree = copy_tree(tmp)
        for row in rows:
            results.append(check(row, tree, args.timeout))
            r = results[-1]
            print(f"{r['result']:<15} {r['seconds']:6.1f}s  {r['name']}  ({r['test']})", flush=True)
    command = "`make sabotage" + (f' ARGS="{shlex.join(sys.argv[1:])}"`' if len(sys.argv) > 1 else "`")
    out = Path(args.out)
    rows_run = results
    if args.only and out.exists():  # a partial run updates its rows of the table, keeps the others
        results = merged(previous_rows(out.read_text()), results)
        command = f"`make sabotage`, the rows it names updated since by {command}"
    text = table(results, command, time.monotonic() - start)
    print("\n" + text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return 0 if all(r["result"] == "CAUGHT" for r in rows_run) else 1


def previous_rows(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 5 and cells[0] not in ("sabotage", "---"):
            name, file, test, result, seconds = cells
            rows.append({"name": name, "file": file.strip("`"), "test": test.strip("`"), "result": result,
                         "seconds": float(seconds)})  # fmt: skip
    return rows


def merged(previous: list[dict], new: list[dict]) -> list[dict]:
    """The table's rows in SABOTAGES order: this run's where it ran them, else the previous ones."""
    by_name = {r["name"]: r for r in previous} | {r["name"]: r for r in new}
    return [by_name[row[0]] for row in SABOTAGES if row[0] in by_name]


if __name__ == "__main__":
    sys.exit(main())
