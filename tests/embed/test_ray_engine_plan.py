"""qwenvl_vision.embed.ray_engine's plan and error lines without a cluster (Ray's entry points replaced by fakes):
a Ray this call started is shut down when the plan fails, GPU actors never outnumber the GPUs, CPU shares add up
to what the cluster has, a head address nothing answers at is refused, the local Ray gets this process's CPUs,
--device defaults as the local engine's does, --attn is checked for the actors' device, pipeline failures are one
line with the right exit code, and actors on a joined cluster load a Hub checkpoint at the run's revision."""

from __future__ import annotations

import argparse
import os
import socket
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from qwenvl_vision.embed import ray_engine  # noqa: E402
from qwenvl_vision.embed.args import add_embed_parser  # noqa: E402
from qwenvl_vision.embed.ray import actor_cpus  # noqa: E402
from qwenvl_vision.errors import ConfigError, EmbedError, OutputFaultError  # noqa: E402


class FakeRay:
    """ray.init / is_initialized / cluster_resources / nodes / shutdown as a cluster of `cpus` CPUs and `gpus` GPUs,
    on one node unless `nodes` lists each node's (CPUs, GPUs)."""

    def __init__(self, monkeypatch, cpus: int, gpus: int = 0, nodes: list[tuple[int, int]] | None = None) -> None:
        self.up, self.inits, self.shutdowns = False, [], 0
        self.resources = {**({"CPU": float(cpus)} if cpus else {}), **({"GPU": float(gpus)} if gpus else {})}
        listed = [{"Alive": True, "Resources": {"CPU": float(c), **({"GPU": float(g)} if g else {})}}
                  for c, g in nodes or [(cpus, gpus)]]
        monkeypatch.setattr(ray, "nodes", lambda: listed + [{"Alive": False, "Resources": {"CPU": 64.0}}])
        monkeypatch.setattr(ray, "is_initialized", lambda: self.up)
        monkeypatch.setattr(ray, "init", self.init)
        monkeypatch.setattr(ray, "shutdown", self.shutdown)
        monkeypatch.setattr(ray, "cluster_resources", lambda: dict(self.resources))

    def init(self, **kwargs) -> None:
        self.up = True
        self.inits.append(kwargs)

    def shutdown(self) -> None:
        self.up = False
        self.shutdowns += 1


@pytest.fixture(autouse=True)
def no_ray_address(monkeypatch):
    """Not the cluster of the shell that runs the tests (a Ray node's, or `ray job submit`'s)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def args(*argv: str, **given) -> argparse.Namespace:
    """An embed run's options with --engine ray, as the job reads them."""
    embed = add_embed_parser(argparse.ArgumentParser().add_subparsers())
    parsed = embed.parse_args(["photos", "--model", "qwen3.5-0.8b", "--out", "out", "--engine", "ray", "--format",
                               "parquet", "--quiet", *argv])
    return argparse.Namespace(**{**vars(parsed), **given})


def plan(options) -> ray_engine.RayPlan:
    return ray_engine.RayPlan.start(options, 1, None, SimpleNamespace(note=lambda line: None))


def test_a_failed_plan_shuts_down_the_ray_it_started(monkeypatch):
    fake = FakeRay(monkeypatch, cpus=4)
    with pytest.raises(EmbedError, match="has no GPU"):
        plan(args(device="cuda"))
    assert (len(fake.inits), fake.shutdowns, fake.up) == (1, 1, False)
    fake.up = True  # a Ray the caller started is left running
    with pytest.raises(EmbedError, match="has no GPU"):
        plan(args(device="cuda"))
    assert fake.shutdowns == 1 and fake.up


def test_the_local_ray_gets_this_process_cpus(monkeypatch):
    fake = FakeRay(monkeypatch, cpus=2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    plan(args())
    assert fake.inits[0]["num_cpus"] == 3
    assert fake.inits[0]["address"] == "local"  # never a `ray start` of this machine, with all its CPUs


def test_a_head_address_nothing_answers_at_is_refused_not_retried_without_end(monkeypatch):
    fake = FakeRay(monkeypatch, cpus=2)
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{head.getsockname()[1]}"
        with pytest.raises(EmbedError, match=address):  # bound, not listening: refused
            plan(args(ray_address=address))
        monkeypatch.setenv("RAY_ADDRESS", address)  # what ray.init joins for "auto" and for no address
        for given in ("auto", None):
            with pytest.raises(EmbedError, match=address):
                plan(args(ray_address=given))
        assert not fake.inits
        head.listen()
        plan(args(ray_address=address))
    assert fake.inits[0]["address"] == address
    fake.shutdown()
    plan(args(ray_address="ray://127.0.0.1:1"))  # Ray Client gives up on its own
    assert fake.inits[1]["address"] == "ray://127.0.0.1:1"


def test_gpu_actors_never_outnumber_the_gpus_and_cuda_is_the_default_on_a_gpu_cluster(monkeypatch):
    FakeRay(monkeypatch, cpus=16, gpus=2)
    with pytest.raises(EmbedError, match="--ray-actors 3: the Ray cluster has 2 GPUs"):
        plan(args(device="cuda", ray_actors=3))
    got = plan(args())
    assert (got.device, got.actors, got.actor_gpus) == ("cuda", 2, 1.0)
    assert plan(args(random_weights=True)).device == "cpu"  # random weights are hashed on the driver's CPU
    assert plan(args(device="cpu")).device == "cpu"
    # The driver needs no GPU of its own: --device cuda is parsed on any machine, and the cluster's GPUs decide.
    assert plan(args("--device", "cuda")).device == "cuda"


def test_cpu_shares_add_up_to_what_the_cluster_has(monkeypatch):
    FakeRay(monkeypatch, cpus=4)
    for actors in (1, 3, 7, 29, 300):
        share = actor_cpus(actors)
        assert share > 0 and actors * share <= 3 + 1e-9, (actors, share)  # one CPU left for the read tasks
    with pytest.raises(ValueError, match="cannot share"):
        actor_cpus(10**6)


@pytest.mark.parametrize(("nodes", "actors"), [([(4, 0)] * 5, 5), ([(16, 0)] * 5, 5), ([(8, 0)] + [(4, 1)] * 4, 4),
                                               ([(2, 0), (64, 0)], 4)])
def test_each_actor_fits_on_one_node_of_the_cluster(monkeypatch, nodes, actors):
    """Ray places an actor on one node that has all it asks for, and Ray Data waits for every actor without end: sized
    by the whole cluster's CPUs, actors on a cluster of more than four nodes fitted on none. Dead nodes count for
    nothing."""
    fake = FakeRay(monkeypatch, cpus=sum(c for c, _ in nodes), gpus=sum(g for _, g in nodes), nodes=nodes)
    got = plan(args())
    fake.up = False  # a local Ray again, which the refusal is for
    room = sum(min(int(c / got.actor_cpus + 1e-9), g if got.actor_gpus else got.actors) for c, g in nodes)
    assert got.actors == actors <= room
    with pytest.raises(EmbedError, match="do not fit on the cluster's nodes"):
        plan(args(threads=max(c for c, _ in nodes) + 1))


def test_actors_a_joined_cluster_cannot_hold_yet_are_said_not_refused(monkeypatch):
    """A cluster's autoscaler adds nodes for actors that wait (a head of no CPUs, no workers yet)."""
    FakeRay(monkeypatch, cpus=0, nodes=[(0, 0)])
    notes: list[str] = []
    got = ray_engine.RayPlan.start(args(ray_address="auto"), 1, None, SimpleNamespace(note=notes.append))
    assert got.actors == 1 and any("do not fit on the cluster's nodes" in n and "autoscaler" in n for n in notes)


def test_attn_is_checked_for_the_actors_device_before_anything_runs(monkeypatch):
    FakeRay(monkeypatch, cpus=4)
    with pytest.raises(ConfigError, match="attn_impl 'flash' is not available"):
        plan(args(attn="flash"))
    with pytest.raises(ConfigError, match="float16/bfloat16 only"):
        ray_engine.check_attn(args(attn="flash", dtype="fp32"), "cuda")
    ray_engine.check_attn(args(attn="sdpa", dtype="fp32"), "cuda")


def test_pipeline_failures_are_one_line_with_the_right_exit_code():
    timeout = ray_engine.pipeline_error(TimeoutError("Get timed out: some object(s) not ready."))
    assert isinstance(timeout, OutputFaultError) and timeout.exit_code == 3
    assert "free space" not in str(timeout) and "--resume" in str(timeout) and "\n" not in str(timeout)
    actor_text = ("The actor died because of an error raised in its creation task, ray::MapWorker.__init__()\n"
                  "  File \"x.py\", line 1\nqwenvl_vision.errors.CheckpointError: /ckpt: the actor's tower hashes "
                  "to 0123456789ab..., the run's to ba9876543210... (another checkpoint)\n")
    setup = ray_engine.pipeline_error(RuntimeError(actor_text))
    assert type(setup) is EmbedError and setup.exit_code == 2
    assert "an actor could not start (CheckpointError: /ckpt: the actor's tower hashes" in str(setup)
    assert "\n" not in str(setup)


def test_actors_on_a_joined_cluster_load_a_hub_checkpoint_at_the_run_revision(tmp_path, monkeypatch):
    fake = FakeRay(monkeypatch, cpus=2)
    snapshot = str(tmp_path / "snapshots" / ("a" * 40))
    hub = {"model": "Qwen/Qwen3-VL-2B-Instruct", "revision": None, "local_files_only": True}
    settings = args(**hub)
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen()
        joined = plan(args(**hub, ray_address=f"127.0.0.1:{head.getsockname()[1]}"))
    job = SimpleNamespace(folder=snapshot, settings=settings, run={"revision": "a" * 40}, ray=joined)
    options: dict = {}
    assert ray_engine.actor_source(job, options) == "Qwen/Qwen3-VL-2B-Instruct"
    assert options == {"revision": "a" * 40, "local_files_only": True}
    job.settings = args(model=str(tmp_path))  # a folder stays one
    assert ray_engine.actor_source(job, {}) == snapshot
    fake.shutdown()
    job.settings, job.ray = settings, plan(settings)  # a local Ray: this machine's folder
    assert ray_engine.actor_source(job, {}) == snapshot
    fake.shutdown()
    with socket.socket() as head:  # joined as `ray job submit` joins
        head.bind(("127.0.0.1", 0))
        head.listen()
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{head.getsockname()[1]}")
        job.ray = plan(settings)
    assert ray_engine.actor_source(job, {}) == "Qwen/Qwen3-VL-2B-Instruct"
