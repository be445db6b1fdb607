"""Shared fixtures: every test must leave no child process, fd or shared memory behind. And the
split of the suite: the tests in ``SLOW`` are marked ``slow``; the README's test command runs the
rest (``-m "not slow"``) and ``.ci/run`` runs these after it (``-m slow``)."""

from __future__ import annotations

import fnmatch
import gc
import multiprocessing as mp
import os
import time
from multiprocessing import resource_tracker

import psutil
import pytest


def _infrastructure(proc: psutil.Process) -> bool:
    """multiprocessing's own long-lived helpers (resource tracker, forkserver)."""
    try:
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return True
    return "resource_tracker" in cmdline or "forkserver" in cmdline


def _our_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if not _infrastructure(p)]


def _shm_segments() -> set[str]:
    """Named segments of this test process (``envmgr_<pid>_...``: the fallback where the shared
    memory cannot be passed as a descriptor)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"envmgr_{os.getpid()}_")}


def _shared_mappings() -> set[str]:
    """This process's mappings of shared memory it made: a memfd or unlinked file named
    ``envmgr_<pid>`` (they have no name in /dev/shm, so only the maps show them), or a segment."""
    marks = (f"/memfd:envmgr_{os.getpid()}", f"/dev/shm/envmgr_{os.getpid()}_")
    with open("/proc/self/maps") as maps:
        return {line.strip() for line in maps if any(mark in line for mark in marks)}


def _fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _describe_fds(fds: set[int]) -> list[str]:
    """Each fd with what it points to (a pipe, socket, eventfd, file), for the failure message."""
    described = []
    for fd in sorted(fds):
        try:
            described.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            described.append(f"{fd} (closed meanwhile)")
    return described


@pytest.fixture(scope="session", autouse=True)
def _sb3_log_folder(tmp_path_factory):
    """SB3's ``learn()`` makes a log folder in /tmp on every call unless ``SB3_LOGDIR`` names
    one: keep them in pytest's temporary directory (the examples run as children inherit it)."""
    os.environ.setdefault("SB3_LOGDIR", str(tmp_path_factory.mktemp("sb3-logs")))


@pytest.fixture(scope="session", autouse=True)
def _start_infrastructure():
    """Start multiprocessing's helpers once, so they are not mistaken for leaks."""
    resource_tracker.ensure_running()
    if "forkserver" in mp.get_all_start_methods():
        from multiprocessing import forkserver

        forkserver.ensure_running()
    yield


@pytest.fixture(autouse=True)
def no_leaks(request):
    """After each test: no child processes, no new fds, no shared memory of ours."""
    fds_before = _fds()
    shm_before = _shm_segments()
    mappings_before = _shared_mappings()
    yield
    deadline = time.monotonic() + 10.0
    while _our_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    children = _our_children()
    for child in children:  # do not poison later tests
        child.kill()
    assert not children, f"child processes left behind: {[c.pid for c in children]}"
    leaked_shm = _shm_segments() - shm_before
    assert not leaked_shm, f"shared memory left behind: {leaked_shm}"
    leaked_maps = _shared_mappings() - mappings_before
    if leaked_maps:  # arrays the test still held, freed with their reference cycles
        gc.collect()
        leaked_maps = _shared_mappings() - mappings_before
    assert not leaked_maps, f"shared memory still mapped: {leaked_maps}"
    leaked_fds = _fds() - fds_before
    if leaked_fds:  # freed with reference cycles, or by a thread still letting go (gRPC's server stop)
        gc.collect()
        fd_deadline = time.monotonic() + 5.0
        while (_fds() - fds_before) and time.monotonic() < fd_deadline:
            time.sleep(0.05)
        leaked_fds = _fds() - fds_before
    assert not leaked_fds, f"file descriptors left open: {_describe_fds(leaked_fds)}"


# ------------------------------------------------------------------ the split: fast and slow
#
# The README's test command (``pytest -m "not slow" -n 3``: three processes) must finish, its
# install included, in under ten minutes on two cores from a fresh clone; ``.ci/run`` runs the
# rest after it (``pytest -m slow``), so CI drops nothing, and a plain ``pytest`` runs both. A test is listed
# here when it takes many seconds and another test of the same layer and fault kind stays in
# the README's set: that set keeps, for every layer (core, the gymnasium / SB3 / SuperSuit
# drop-ins, the samplers, Ray, ML-Agents over gRPC), real runs with envs or players that raise,
# die and hang (on Ray: an env raising or killed in a node, a node killed, a node hung) and with
# failing policies. Keys: the test's id below ``tests/``, shell-style patterns (``[[]`` is a
# literal ``[``). Why each is slow is said next to it.
SLOW_BECAUSE = {
    "a peer's own test suite": [
        "test_sb3_own_suite.py::*",  # SB3's own VecEnv suite on our SubprocVecEnv, ~75 s
    ],
    "long randomized schedules and properties (processes started per example)": [
        "test_fault_schedules.py::*",
        "test_fault_schedules_dropins.py::*",
        "test_fault_schedules_ray.py::*",
        "test_fault_schedules_pettingzoo.py::*",
        "mlagents/test_fault_schedules_mlagents.py::*",
        "test_envpool_loop.py::test_envpool_loop_*",  # its hypothesis properties; the regressions stay
        "vector/test_sloppy_returns.py::test_*_sloppy_returns_as_reference*",  # 50 examples each
    ],
    "examples and quick starts that train (torch, SB3's PPO, a learning curve)": [
        "test_examples.py::test_sb3_ppo_learns_cartpole",
        "test_examples.py::test_async_ppo_with_learner_feed_return_rises",
        "test_examples.py::test_sync_sampler_loop_return_rises",
        "test_examples.py::test_mlagents_training_reward_rises",
        "test_examples.py::test_readme_quick_start_runs_as_written[[]sb3]",
        "test_examples.py::test_readme_quick_start_runs_as_written[[]pettingzoo]",
        "test_pettingzoo_supersuit.py::test_sb3_ppo_trains_through_the_drop_in_with_supersuits_wrappers",
    ],
    "a hang waited out at a deadline that must also cover a start-up (spawn, a Ray node, a player)": [
        # the samplers' matrix keeps the parent-side sampler's hangs (3 s each); the worker-side
        # sampler's hang stays in test_worker_sampler.py
        "test_sampler_faults.py::*[[]sampler-k2-*_hang]",
        "test_sampler_faults.py::*[[]worker-*_hang]",  # 6 s under fork, 15 s under spawn
        "test_env_named.py::test_the_samplers_name_the_env[[]*-step_hang-*]",  # the drop-ins' stay
        "test_pettingzoo_sampler.py::*[[]hang-*workers]",
        "test_ray_faults.py::test_env_fault[[]*_hang-*]",  # 10 s inside a node
        "test_ray_faults.py::test_node_fault[[]node_hang-on]",  # 10 s in the driver; -off stays
        "test_ray.py::test_a_slow_restart_does_not_make_a_healthy_node_hung",
        "mlagents/test_attach.py::test_lost_player_is_an_error_naming_its_address_and_nothing_is_killed[[]hang]",
        "mlagents/test_attach.py::test_a_player_that_never_connects_is_an_error_naming_its_address",
        "mlagents/test_fake_unity.py::test_step_latency_and_its_env_parameter",
        "mlagents/test_env_manager.py::test_hung_player_is_restarted_and_the_orphan_killed",
        "test_worker_sampler.py::test_a_fragment_longer_than_the_deadline_is_not_hung_while_it_writes_rows",
        "test_ray_faults.py::test_a_node_that_never_starts_again_is_given_up_at_the_deadline_with_the_limits_lifted",
        "test_check.py::test_a_fresh_env_run_longer_than_the_start_up_deadline_is_not_a_hang",  # the time-limit one stays
    ],
    "Ray: further cases of a fault the README's set runs once, and sessions, clusters, nodes lost": [
        "test_ray_faults.py::test_env_fault[[]*-nodes]",
        "test_ray_faults.py::test_env_fault[[]reset_*]",
        "test_ray_faults.py::test_env_fault[[]step_raise-off]",
        "test_ray_faults.py::test_env_fault[[]step_kill-on]",
        "test_ray_faults.py::test_env_fault[[]update_raise-*]",
        "test_ray_faults.py::test_policy_fault[[]*-on]",
        "test_ray_faults.py::test_policy_fault[[]policy_count-off]",
        "test_ray_faults.py::test_policy_fault[[]policy_dtype-off]",
        "test_ray_faults.py::test_policy_fault[[]policy_range-off]",
        "test_ray_faults.py::test_node_fault[[]node_kill-off]",
        "test_ray_faults.py::test_a_cut_inside_a_node_flags_the_rows_the_driver_holds",
        "test_ray_faults.py::test_close_mid_call_ends_the_call",
        "test_ray_faults.py::test_episodes_of_a_call_that_raised_are_dropped_and_counted",
        "test_ray_faults.py::test_a_round_cut_by_a_nodes_error_keeps_the_fragments_that_came",  # a node's steps take 1 s
        "test_ray_faults.py::test_every_request_a_node_raised_on_before_its_restart_is_answered_lost",  # slow envs, a wait
        "test_ray_faults.py::test_a_node_that_answered_an_env_error_and_then_died_is_told_for_both[[]nodes-*]",  # -off-1 stays
        "test_ray_faults.py::test_a_node_that_answered_an_env_error_and_then_died_is_told_for_both[[]on-*]",
        "test_ray_faults.py::test_a_node_that_answered_an_env_error_and_then_died_is_told_for_both[[]off-2]",
        "test_ray.py::test_a_restarted_node_replays_no_seeded_episode_and_its_ids_go_on",
        "test_ray.py::test_a_node_restarted_while_its_answers_are_taken_goes_on_from_them",
        "test_ray.py::test_an_update_that_cannot_be_sent_is_not_recorded_and_nodes_agree_after_a_restart",
        "test_ray.py::test_a_node_that_fails_to_start_leaves_no_node_behind",
        "test_ray.py::test_an_update_from_a_learner_thread_while_a_node_restarts_is_applied_there_once",  # (the other stays)
        "test_ray_faults.py::test_a_restarted_node_that_fails_to_start_is_restarted_again_within_the_limits[[]2]",  # [1] stays
        "test_ray.py::test_unplaceable_node_is_an_error_after_start_timeout_and_bad_input_first",
        "test_ray.py::test_a_nodes_answers_are_booked_in_the_order_it_was_asked",
        "test_ray.py::test_a_node_whose_runtime_env_fails_is_a_node_error",
        "test_ray_cluster.py::*",  # a second raylet
        "test_ray_session.py::test_a_session_*",  # sessions of their own
        "test_ray_session.py::test_the_users_session_*",
        "test_ray_records.py::*",  # nodes lost (a Ray session for the module)
        "test_ray_supervisor.py::*",  # a node restarted, then given up (a Ray session for the module)
        "mlagents/test_ray_players.py::test_a_*",  # players' nodes lost, silent, restarted: 8-27 s each
    ],
    "ML-Agents: further restarts and a lost attached player (a crash, a hang, attaching stay)": [
        "mlagents/test_recorded_actions.py::test_a_change_while_a_player_restarts_reaches_its_first_episode",
        "mlagents/test_recorded_actions.py::test_after_a_restart_noticed_during_a_settings_change",
        "mlagents/test_attach.py::test_lost_player_is_an_error_naming_its_address_and_nothing_is_killed[[]exit]",
    ],
    "Ctrl-C pressed hundreds of times: further layers of a program the README's set runs once": [
        # the ML-Agents manager without Ray, the Ray sampler, SuperSuit's gymnasium base class and the
        # samplers' other variants stay
        "test_interrupts.py::test_caught_ctrl_c_leaves_the_mlagents_manager_in_step[[]True]",  # on Ray, ~17 s
        "test_interrupts.py::test_caught_ctrl_c_leaves_the_supersuit_dropin_in_step[[]stable_baselines3]",
        "test_interrupts.py::test_caught_ctrl_c_leaves_the_samplers_in_step[[]True-True-steps-2]",
    ],
    "measurements, benchmark and CLI runs of several seconds in fresh interpreters (the harness stays)": [
        "test_check_advice.py::test_double_buffering_is_measured_only_where_the_parent_has_a_core",
        "test_check_advice.py::test_a_1ms_cpu_bound_env_goes_to_processes_packed_as_auto_packs_them",
        "test_check_advice.py::test_a_nearly_free_env_is_faster_in_process",
        "test_check_cli.py::test_command_line_reports_a_good_env_as_json_and_exits_0",  # every start method
        "test_check_cli.py::test_the_fixture_and_the_marker_fail_a_test_with_the_report",  # pytest in pytest
        "test_bench.py::test_unity_scenario",
        "test_bench.py::test_more_backends_and_skips",
        "test_bench_scale.py::test_cycle_runs_its_contenders_pinned",
        "test_bench_scale.py::test_scale_runs_every_case_end_to_end",
        "test_bench_real.py::test_sweep_runs_every_step_cost_against_the_limit",
    ],
}
SLOW = {pattern: why for why, patterns in SLOW_BECAUSE.items() for pattern in patterns}
TESTS = os.path.dirname(os.path.abspath(__file__))


def _test_id(item: pytest.Item) -> str:
    """``file::name[params]`` with the file's path below ``tests/`` (wherever pytest runs from)."""
    return os.path.relpath(str(item.path), TESTS).replace(os.sep, "/") + "::" + item.nodeid.split("::", 1)[1]


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect
def pytest_collection_modifyitems(config, items):
    matched, files = set(), set()
    for item in items:
        test_id = _test_id(item)
        files.add(test_id.split("::", 1)[0])
        hits = [pattern for pattern in SLOW if fnmatch.fnmatchcase(test_id, pattern)]
        if hits:
            item.add_marker(pytest.mark.slow)
            matched.update(hits)
    # A pattern that names no test (one renamed) would silently put it back in the README's set.
    # Checked where pytest collects whole files (no test ids or paths given), for the files it did.
    sources = getattr(pytest.Config, "ArgsSource", None)
    if sources is not None and config.args_source == sources.TESTPATHS:
        stale = sorted(p for p in set(SLOW) - matched if p.split("::", 1)[0] in files)
        if stale:
            raise pytest.UsageError(f"tests/conftest.py, SLOW_BECAUSE: these name no test: {stale}")
