"""The Kubernetes examples (examples/k8s/): JobSets whose structure, environment and
command agree with what spmd and JAX read. No cluster runs them here: each manifest is
checked for the fields JobSet and the Job API require of it, its processes' count against
the mesh, and its command against spmd.train's own flag parser."""

from pathlib import Path

import pytest
import yaml

from spmd.parallel.mesh import explicit_product
from spmd.run.resolve import parse_args

K8S = Path(__file__).parents[1] / "examples" / "k8s"
DEVICES_PER_POD = {"nvidia.com/gpu", "google.com/tpu"}


def _workers(manifest: dict) -> tuple[dict, dict, dict]:
    """(the replicated job, its Job spec, its only container)"""
    assert manifest["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and manifest["kind"] == "JobSet"
    [replicated] = manifest["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    [container] = job["template"]["spec"]["containers"]
    return replicated, job, container


@pytest.mark.parametrize("name", ["jobset-gpu.yaml", "jobset-tpu.yaml"])
def test_each_jobset_starts_one_process_per_host_for_the_mesh_of_its_command(name):
    manifest = yaml.safe_load((K8S / name).read_text())
    replicated, job, container = _workers(manifest)
    # Indexed: each pod knows its index (the process id); all pods run at once, none retried alone.
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    assert job["template"]["spec"]["terminationGracePeriodSeconds"] >= 60  # a step and a save after SIGTERM
    command = container["command"]
    assert command[:3] == ["python", "-m", "spmd.train"]
    cfg = parse_args(command[3:])
    [(kind, per_pod)] = [(k, v) for k, v in container["resources"]["limits"].items() if k in DEVICES_PER_POD]
    processes = job["parallelism"] * replicated["replicas"]
    assert explicit_product(cfg.parallelism.mesh_spec.sizes) == processes * per_pod, (kind, cfg.parallelism.mesh)
    if cfg.parallelism.mesh_spec.dcn:
        assert explicit_product(cfg.parallelism.mesh_spec.dcn) == processes  # --dcn spans the pods (hosts)
    env = {e["name"]: e for e in container.get("env", [])}
    ports = {p["containerPort"] for p in container["ports"]}
    if cfg.processes.coordinator == "auto":  # a TPU slice: JAX reads GKE's TPU_WORKER_* variables
        assert kind == "google.com/tpu" and not env
        return
    # Otherwise the three variables spmd reads, the coordinator being pod 0 of the headless service.
    assert env["JAX_NUM_PROCESSES"]["value"] == str(processes)
    assert env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["JOBSET_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['jobset.sigs.k8s.io/jobset-name']"
    host, port = env["JAX_COORDINATOR_ADDRESS"]["value"].rsplit(":", 1)
    assert host == f"$(JOBSET_NAME)-{replicated['name']}-0-0.$(JOBSET_NAME)" and int(port) in ports
