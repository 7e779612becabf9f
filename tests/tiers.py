"""The suite's tiers and areas (docs/contributing.md).

- The *gate* is what `pytest` runs (the README's test command): every area's strongest
  tests, within 20 minutes on a 2-core machine.
- The *slow* tier is everything else: more layouts of what the gate already holds once,
  plans of many devices, end-to-end runs of many processes. `--tier slow` runs it,
  `--tier all` runs both, `--slow-slice K/N` keeps the K-th of N slices of the slow tier
  (CI runs one slice a commit, in turn: .ci/run).
- Every test also carries the marker of its *area* (`-m pipelines`, `-m "hf or lora"`), and
  the tests that CI repeats on the oldest supported JAX carry `floor`.

What is slow is listed here, by test id, rather than marked in each file: the gate is read
in one place, and `test_tiers.py` fails on a pattern that no longer matches a test.
"""

import argparse
import heapq
import json
import os
import re
import tempfile
from pathlib import Path

import pytest

# Each module's areas: `pytest -m AREA` runs the tests of what you change.
AREAS = {
    "test_attention_kernels": ("kernels", "parity"),
    "test_bad_input": ("cli",),
    "test_bad_files": ("cli", "data"),
    "test_balance": ("moe", "parity"),
    "test_checkpoint": ("checkpoint", "parity"),
    "test_checkpoint_integrity": ("checkpoint",),
    "test_cli_errors": ("cli",),
    "test_cluster_files": ("cluster",),
    "test_combinations": ("plan", "parity"),
    "test_composition": ("pipelines", "moe", "parity"),
    "test_config": ("cli",),
    "test_corpus": ("data",),
    "test_data": ("data",),
    "test_deepseek": ("hf", "moe", "pipelines", "parity"),
    "test_default_run": ("cli",),
    "test_docs": ("docs",),
    "test_faults": ("checkpoint", "cli"),
    "test_finetune": ("data", "hf"),
    "test_fit": ("plan",),
    "test_generate": ("generate", "hf"),
    "test_hardening_data": ("data", "cli"),
    "test_hardening_defaults": ("cli", "generate"),
    "test_hardening_inputs": ("cli",),
    "test_hf": ("hf",),
    "test_hf_files": ("hf",),
    "test_hlo": ("plan", "parity"),
    "test_layers": ("docs",),
    "test_lora": ("lora", "parity"),
    "test_model": ("model",),
    "test_moe": ("moe", "parity"),
    "test_mtp": ("model", "moe", "pipelines", "parity"),
    "test_multihost": ("cluster", "checkpoint"),
    "test_network": ("cluster",),
    "test_notebooks": ("docs",),
    "test_objective": ("model", "hf"),
    "test_observe": ("cli",),
    "test_outputs": ("cli",),
    "test_packing": ("data", "parity"),
    "test_parity": ("parity",),
    "test_pipeline": ("pipelines", "parity"),
    "test_plan": ("plan",),
    "test_preemption": ("checkpoint",),
    "test_presets": ("plan",),
    "test_readme": ("docs", "cli"),
    "test_records": ("data",),
    "test_sequence_parallel": ("parity",),
    "test_sharding": ("parity",),
    "test_slurm": ("cluster",),
    "test_targets": ("plan",),
    "test_tiers": ("docs",),
    "test_tools_hardening": ("cli",),
    "test_xla_flags": ("cli",),
}
MARKERS = {
    "slow": "the slow tier: not in the gate (`--tier slow` or `--tier all` runs it)",
    "floor": "repeated by CI on the oldest supported JAX (.ci/floor.txt)",
    **{area: f"area: {area}" for area in sorted({a for areas in AREAS.values() for a in areas})},
}

# The slow tier. Each area keeps in the gate (GATE) its strongest tests: a parity layout per
# axis and per schedule, the goldens against transformers and peft, the bad-input tables,
# checkpoints and faults, the docs' cheap commands. What goes slow here is held in the gate by
# a sibling: other layouts of a mechanism the gate trains once, plans of many devices, runs
# of several processes and hosts (SLURM, a real network), the notebooks.
SLOW = [
    # More layouts of what the gate's parity tests hold once each (support.parity's shared runs).
    "tests/test_parity.py::*",
    "tests/test_pipeline.py::test_pipeline_matches_one_device*",
    "tests/test_pipeline.py::test_plan_matches_the_compiled_pipeline*",
    "tests/test_pipeline.py::test_zb_v_activations_do_not_grow_with_microbatches",
    "tests/test_pipeline.py::test_interleaved_one_f_one_b_keeps_about_one_f_one_bs_activations",
    "tests/test_pipeline.py::test_split_backward_executes_its_formula*",  # the gate holds the formula of GPipe, circular, 1F1B
    "tests/test_composition.py::*",
    "tests/test_moe.py::test_expert_parallel_layout_matches_one_device*",
    "tests/test_moe.py::test_tokens_move_by_all_to_all*",
    "tests/test_moe.py::test_with_sp_capacity_drops_what_one_device_drops",
    "tests/test_balance.py::test_balancing_in_pipeline_stages_matches_one_device*",
    "tests/test_balance.py::test_expert_copies_match_one_device_across_a_rebalancing*",
    "tests/test_balance.py::test_a_run_with_copies_and_bias_resumes_on_another_ep_size_and_serves_as_trained",
    "tests/test_deepseek.py::test_layout_matches_one_device*",
    "tests/test_deepseek.py::test_empty_layers_even_out_the_stages_without_changing_the_numbers",
    "tests/test_deepseek.py::test_the_checkpoints_selection_bias_moves_with_the_run_and_is_exported",
    "tests/test_mtp.py::test_layout_matches_one_device*",  # the gate holds the reference's equations on packed rows
    "tests/test_mtp.py::test_the_loss_and_its_gradients_are_the_reports_equations[rows]",
    "tests/test_mtp.py::test_the_plan_counts_the_prediction_modules*",
    "tests/test_mtp.py::test_a_run_with_expert_copies_and_prediction_exports_the_model",  # but DualPipe's, in the gate (GATE)
    # A TPU compile of DeepSeek's stages (the gate compiles the default kernel for a TPU slice).
    "tests/test_targets.py::test_a_dense_prefix_attends_to_its_own_rows_outside_the_stages",
    "tests/test_lora.py::test_adapter_gradients_equal_one_devices*",
    "tests/test_lora.py::test_lora_run_checkpoints_adapters_resumes_on_another_mesh_and_exports",
    "tests/test_packing.py::test_packed_rows_train_as_one_example_per_row*",
    "tests/test_objective.py::test_the_pooled_balance_loss_is_the_same_on_any_layout",
    "tests/test_model.py::test_moe_layer_capacity_without_drops_equals_dropless*",
    "tests/test_model.py::test_remat_changes_memory_not_gradients[dots]",
    "tests/test_finetune.py::test_eval_is_transformers_mean_loss_over_the_targets*",
    "tests/test_checkpoint.py::test_resume_on_another_mesh_continues_the_run*",
    "tests/test_plan.py::test_every_row_of_a_pair_of_features_matches_theory*",
    "tests/test_plan.py::test_llama3_70b_plans_on_tp_16_beyond_its_8_kv_heads",
    "tests/test_hlo.py::test_grad_accumulation_with_sp_or_split_experts*",
    # The goldens: every family's logits stay in the gate; the rest of the generation and round trips here.
    "tests/test_generate.py::*",
    "tests/test_hf.py::test_import_then_export_gives_the_same_tensors*",
    # Plans of real clusters' presets (up to 128 emulated devices).
    "tests/test_presets.py::test_preset_plans_cleanly_and_fits*",
    # Several processes and hosts: SLURM, two network namespaces; faults of two processes.
    "tests/test_slurm.py::*",
    "tests/test_network.py::*",
    "tests/test_multihost.py::test_killing_one_process_makes_the_other_exit_with_an_error",
    "tests/test_faults.py::test_two_processes_stop_after_the_same_step_when_one_is_told_to",
    "tests/test_faults.py::test_a_non_finite_update_is_dropped_even_when_loss_and_gradient_are_finite",
    "tests/test_faults.py::test_an_out_that_cannot_be_written_is_refused_before_anything_runs",  # test_outputs' too
    "tests/test_observe.py::test_a_run_resumed_past_the_profiled_steps_says_so_and_traces_nothing",
    "tests/test_preemption.py::test_sigterm_finishes_the_step_saves_and_exits_0",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom*",
    # The docs' commands that train or plan a layout the gate's tests hold (README's examples).
    "tests/test_readme.py::test_readme_command_runs_as_written*",
]
# Held in the gate though a pattern above names them: one of each kind.
GATE = [
    *[f"tests/test_parity.py::test_layout_matches_one_device[{layout}]" for layout in (
        "dp=8", "fsdp=8", "dp=2,fsdp=2,tp=2", "dp=8-zero1", "dp=4,tp=2-zero3", "1dev-grad_accum4", "tp=8",
        "ep=2,sp=2,tp=2", "sp=4-attentionring", "sp=4-attentionall-gather", "tp=2-megatron_spTrue")],
    "tests/test_parity.py::test_family_layout_matches_one_device[qwen3-fsdp=2,tp=4]",
    *[f"tests/test_pipeline.py::test_pipeline_matches_one_device[{layout}]" for layout in (
        "pp=4-microbatches8", "pp=4-pp_schedulecircular-pp_repeats2-microbatches4", "pp=4-pp_schedule1f1b-microbatches8",
        "pp=4-pp_scheduleinterleaved-1f1b-pp_repeats2-microbatches8", "pp=2,dp=2,tp=2-pp_schedule1f1b-microbatches4",
        "pp=4-pp_schedulezb-v-microbatches8", "pp=2-pp_scheduledualpipe-microbatches4")],
    *[f"tests/test_moe.py::test_expert_parallel_layout_matches_one_device[{layout}]" for layout in (
        "ep=2-dropless", "ep=4-dropless", "ep=2,fsdp=2,tp=2-capacity", "sp=2-dropless-accum")],
    "tests/test_balance.py::test_expert_copies_match_one_device_across_a_rebalancing[ep4-capacity]",
    "tests/test_lora.py::test_adapter_gradients_equal_one_devices[fsdp=2,tp=2]",
    "tests/test_lora.py::test_adapter_gradients_equal_one_devices[pp=2,dp=2-1f1b]",
    "tests/test_packing.py::test_packed_rows_train_as_one_example_per_row[-1-overrides0]",
    "tests/test_finetune.py::test_eval_is_transformers_mean_loss_over_the_targets[chat-dp=2,tp=2]",
    "tests/test_checkpoint.py::test_resume_on_another_mesh_continues_the_run[fsdp=2,tp=2-4-0]",
    "tests/test_plan.py::test_every_row_of_a_pair_of_features_matches_theory[fsdp+LoRA]",
    "tests/test_plan.py::test_every_row_of_a_pair_of_features_matches_theory[sp+MoE+grad-accum]",
    *[f"tests/test_generate.py::{name}" for name in (
        "test_greedy_equals_transformers_generate[llama-gqa-dp=1]",
        "test_greedy_equals_transformers_generate[mixtral-dp=2,ep=2,tp=2]",
        "test_greedy_is_the_argmax_and_filters_keep_the_best", "test_sampling_follows_temperature_top_k_and_top_p*")],
    "tests/test_presets.py::test_preset_plans_cleanly_and_fits[llama3-8b-8xh100]",
    "tests/test_mtp.py::test_the_plan_counts_the_prediction_modules[pp=2,ep=2-mtp_depth2-*]",
    # The docs' commands that make and read files (checkpoints, exports, adapters, tokens), and
    # those refused here by the fit check.
    *[f"tests/test_readme.py::test_readme_command_runs_as_written[*{text}*]" for text in (
        "runs/", "tokens.npy", "packed.npy", "exported", "Llama-3.2-1B-ft", "llama3-8b-8xh100.yaml --steps")],
]

# The floor pass (.ci/run on the oldest JAX): what can differ between JAX versions — the
# partitioner's programs (one parity layout per axis, each schedule's shard_map), the MoE
# exchange, Orbax's checkpoints, the goldens' numbers, the plan's reading of the HLO.
FLOOR = [
    *[f"tests/test_parity.py::test_layout_matches_one_device[{layout}]" for layout in (
        "dp=8", "fsdp=8", "dp=2,fsdp=2,tp=2", "dp=8-zero1", "1dev-grad_accum4", "ep=2,sp=2,tp=2", "sp=4-attentionring",
        "tp=2-megatron_spTrue")],
    *[f"tests/test_pipeline.py::test_pipeline_matches_one_device[{layout}]" for layout in (
        "pp=4-microbatches8", "pp=2,dp=2,tp=2-pp_schedule1f1b-microbatches4", "pp=4-pp_schedulezb-v-microbatches8")],
    "tests/test_moe.py::test_expert_parallel_layout_matches_one_device[ep=2-dropless]",
    "tests/test_moe.py::test_ragged_*",
    "tests/test_checkpoint.py::test_resume_on_the_same_mesh_is_bit_identical",
    "tests/test_checkpoint.py::test_resume_on_another_mesh_continues_the_run[fsdp=2,tp=2-4-0]",
    "tests/test_hf.py::test_logits_equal_transformers*",
    "tests/test_attention_kernels.py::test_splash_*",
    "tests/test_attention_kernels.py::test_chunked_kernel_equals_materialized_scores*",
    "tests/test_hlo.py::*",
    "tests/test_plan.py::test_compiled_collectives_and_state_match_theory*",
    "tests/test_sequence_parallel.py::*",
    "tests/test_objective.py::test_the_warmup_is_kept_as_given*",
    "tests/test_cli_errors.py::*",
    # The gate's tests that say by a marker why they are left out on the floor (libtpu's wheels
    # are cp312+; XLA 0.10 orders the step's buffers otherwise): the pass lists them with their
    # reasons (`-rs`). And the LoRA run whose tolerance was set by what both JAX versions round.
    "tests/test_targets.py::*",
    "tests/test_pipeline.py::test_dualpipe_copies_no_stage_to_pick_one",
    "tests/test_pipeline.py::test_split_backward_rings_are_written_in_place",
    "tests/test_pipeline.py::test_the_tables_gradient_zeros_are_made_after_the_stages*",
    "tests/test_lora.py::test_a_lora_run_starts_as_its_base_trains_only_its_adapters_and_matches_one_device",
]

TIERS = ("gate", "slow", "all")


def add_options(parser) -> None:
    group = parser.getgroup("spmd tiers")
    group.addoption("--tier", choices=TIERS, default="gate",
                    help="gate (default: the README's test command), slow, or all of the suite")
    group.addoption("--slow-slice", metavar="K/N", default=None, type=_slice,
                    help="of the slow tier (--tier slow or all), keep only slice K of N (0 <= K < N)")
    group.addoption("--list-tiers", metavar="FILE", default=None,
                    help="write every collected test's id, unit and tier to FILE as JSON (tests/test_tiers.py)")


def configure(config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    # Refused here, before collecting (a minute) and before pytest-xdist starts its workers.
    if config.getoption("--slow-slice") and config.getoption("--tier") == "gate":
        raise pytest.UsageError("--slow-slice takes a slice of the slow tier: add --tier slow (or --tier all)")
    if config.getoption("--list-tiers") is not None:
        check_list_tiers(config.getoption("--list-tiers"))


def check_list_tiers(name: str) -> None:
    """`--list-tiers FILE`: one line saying why FILE cannot be written, and nothing written."""
    path = Path(name)
    if not name:
        why = "takes a file name"
    elif path.is_dir():
        why = "is a directory, not a file"
    elif not path.parent.is_dir():
        why = f"{path.parent} is not a directory" if path.parent.exists() else f"no such directory: {path.parent}"
    elif path.exists():
        if os.access(path, os.W_OK):
            return
        why = "permission denied (or a read-only file system)"
    else:
        try:  # a file made there and removed at once, as the one written after collecting would be made
            tempfile.TemporaryFile(dir=path.parent).close()
            return
        except OSError as e:
            why = f"cannot make a file in {path.parent}: {e.strerror}"
    raise pytest.UsageError(f"--list-tiers {name!r}: {why}")


def select(config, items: list) -> None:
    """Mark every test with its areas and tiers, then keep those of the tier asked for."""
    for item in items:
        module = item.module.__name__
        if module not in AREAS:
            raise pytest.UsageError(f"{module} has no area: add it to AREAS in tests/tiers.py")
        for name in AREAS[module]:
            item.add_marker(name)
        if matches(item, SLOW) and not matches(item, GATE):
            item.add_marker("slow")
        if matches(item, FLOOR):
            item.add_marker("floor")
    if config.getoption("--list-tiers") is not None:
        listed = [{"id": item.nodeid, "unit": unit(item), "slow": is_slow(item),
                   "floor": item.get_closest_marker("floor") is not None} for item in items]
        try:  # (checked at configure; what can still fail here, a full disk, is said the same way)
            Path(config.getoption("--list-tiers")).write_text(json.dumps(listed))
        except OSError as e:
            raise pytest.UsageError(f"--list-tiers {config.getoption('--list-tiers')!r}: {e.strerror}") from None
    tier, cut = config.getoption("--tier"), config.getoption("--slow-slice")
    keep = {"gate": lambda i: not is_slow(i), "slow": is_slow, "all": lambda i: True}[tier]
    chosen = set(one_slice([(unit(i), i) for i in items if is_slow(i)], *cut)) if cut else None
    kept, dropped = [], []
    for item in items:
        wanted = keep(item) and (chosen is None or not is_slow(item) or item in chosen)
        (kept if wanted else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def matches(item, patterns: list[str]) -> bool:
    # (Read before pytest-xdist's workers add `@group` to the id: conftest's hook runs first.)
    return any(pattern_matches(p, item.nodeid) for p in patterns)


def pattern_matches(pattern: str, name: str) -> bool:
    """`*` matches anything; every other character only itself (test ids hold brackets)."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), name) is not None


def is_slow(item) -> bool:
    return item.get_closest_marker("slow") is not None


def unit(item) -> str:
    """What a slice keeps together: the tests of one xdist group (they share fixtures that
    are paid once per run; each test of a group in SPLIT_GROUPS alone), else of one module."""
    group = item.get_closest_marker("xdist_group")
    if group and group.args[0] in SPLIT_GROUPS:
        return f"group:{group.args[0]}:{item.nodeid}"
    return f"group:{group.args[0]}" if group else item.module.__name__


def slices(tests: list[tuple[str, object]], n: int) -> list[list]:
    """The slow tests in n slices of about equal cost: each unit whole, the costliest first,
    into the slice that costs least so far (ties by index). Deterministic: a function of the
    units alone."""
    by_unit: dict[str, list] = {}
    for name, test in tests:
        by_unit.setdefault(name, []).append(test)
    heap = [(0.0, k) for k in range(n)]
    out: list[list] = [[] for _ in range(n)]
    for name in sorted(by_unit, key=lambda u: (-unit_cost(u, len(by_unit[u])), u)):
        cost, k = heapq.heappop(heap)
        out[k] += by_unit[name]
        heapq.heappush(heap, (cost + unit_cost(name, len(by_unit[name])), k))
    return out


def one_slice(tests: list[tuple[str, object]], k: int, n: int) -> list:
    """Slice k of `slices(tests, n)`, in memory and time that do not grow with n
    (`--slow-slice 0/100000000`): while a unit is left to place, one of the first U slices
    (U units) is still empty, and a tie of costs goes to the lower index, so no unit goes
    past them; the first U are those of `slices(tests, U)`, the rest empty. For every n,
    the same tests as `slices`."""
    parts = slices(tests, min(n, len({name for name, _ in tests})))
    return parts[k] if k < len(parts) else []


# Seconds of test time each unit of the slow tier took on this machine (2 cores, two workers
# sharing them; the slow tier's durations alone, 2026-12-06), to balance the slices; a unit not
# listed is guessed at 20 s a test. Rough is enough.
UNIT_SECONDS = {
    "group:layouts": 320, "group:pipeline": 280, "group:multihost": 270, "test_deepseek": 170, "group:moe": 165,
    "group:generate": 150, "group:composition": 140, "group:hf": 140, "group:mtp": 140, "group:balance-stages": 125,
    "group:presets": 105, "group:balance": 90, "group:deepseek": 85, "test_notebooks": 80, "test_packing": 80,
    "test_checkpoint": 55, "test_mtp": 65, "test_objective": 20, "test_targets": 20, "test_faults": 20,
    "test_model": 20, "test_preemption": 20, "test_hlo": 20, "test_observe": 10, "test_finetune": 10,
}
# Groups whose tests share nothing costly (the README's commands share one driver's imports,
# seconds): a slice takes their tests one by one, at these seconds a test (313 s for 33
# commands), so that the group's minutes spread over the slices.
SPLIT_GROUPS = {"readme": 10}


def unit_cost(name: str, tests: int) -> float:
    kind, _, rest = name.partition(":")
    group, _, test = rest.partition(":")
    if kind == "group" and test and group in SPLIT_GROUPS:
        return SPLIT_GROUPS[group] * tests
    return UNIT_SECONDS.get(name, 20.0 * tests)


def _slice(text: str) -> tuple[int, int]:
    shown = repr(text if len(text) <= 40 else text[:40] + "...")  # (a number of 5,000 digits is not echoed whole)
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:  # (also a number past Python's 4,300 digits)
        raise argparse.ArgumentTypeError(f"takes K/N, two whole numbers, not {shown}") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"{shown}: K must be 0 to N-1")
    return k, n
