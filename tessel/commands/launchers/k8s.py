"""`tessel launch k8s`: a Kubeflow PyTorchJob that runs a recipe on N pods, with its recipe and checkpoint volume.

Three objects, one YAML stream (`kubectl apply -f`):
- a ConfigMap holding the frozen recipe (tessel.commands.launchers.job), mounted at
  /etc/tessel/recipe.toml;
- a PersistentVolumeClaim (ReadWriteMany: every pod writes there) for the run's
  folder and its checkpoints, mounted at /tessel/runs (or `--pvc NAME`, a claim
  that exists already);
- the PyTorchJob (Kubeflow Training Operator, kubeflow.org/v1): one Master pod
  and N-1 Worker pods, each running one torchrun for G ranks. The operator gives
  every replica a headless Service of its own and sets MASTER_ADDR (the Master
  pod's service name) and MASTER_PORT (the container port named
  `pytorchjob-port`) in each pod; torchrun's c10d rendezvous runs on
  `$(MASTER_ADDR):$(MASTER_PORT)`, which Kubernetes expands from those
  variables, and the Master, whose hostname that is, hosts it.

Preemption: a deleted or evicted pod gets SIGTERM and terminationGracePeriodSeconds
(--grace) before SIGKILL: the ranks save a preemption checkpoint. torchrun then
exits non-zero, restartPolicy OnFailure restarts the pods (up to runPolicy
backoffLimit), and `--resume auto` continues from the checkpoint. /dev/shm is a
memory volume: NCCL and tessel's control folder use it, and a pod's default is 64 MiB.
"""

from __future__ import annotations

import re

import yaml

from tessel.config import ConfigError
from tessel.commands.launchers.job import ClusterJob, torchrun_argv

RECIPE_DIR = "/etc/tessel"
RUNS_DIR = "/tessel/runs"
PORT = 23456  # the operator's default for the port named pytorchjob-port
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # a PyTorchJob's name (the operator's webhook checks it)
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?$")


def check_k8s_options(name: str, image: str, namespace: str | None, storage: str, pvc: str | None,
                      backoff_limit: int) -> None:
    """The flags, before anything is written: ConfigError naming the flag."""
    if not _DNS_1035.match(name) or len(name) > 40:
        raise ConfigError("--name", f"'{name}' must be lower-case letters, digits and '-', start with a letter, at "
                          "most 40 characters (pods are named <name>-worker-<i>)")
    if not image or any(c.isspace() for c in image):
        raise ConfigError("--image", f"'{image}' is not a container image reference")
    if namespace is not None and (not _DNS_1035.match(namespace) or len(namespace) > 63):
        raise ConfigError("--namespace", f"'{namespace}' is not a Kubernetes namespace name")
    if pvc is not None and (not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", pvc) or len(pvc) > 253):
        raise ConfigError("--pvc", f"'{pvc}' is not a Kubernetes object name")
    if not _QUANTITY.match(storage):
        raise ConfigError("--storage", f"'{storage}' is not a Kubernetes quantity (e.g. 500Gi)")
    if backoff_limit < 0:
        raise ConfigError("--max-restarts", f"must be at least 0 (got {backoff_limit})")


def manifest(job: ClusterJob, name: str, image: str, namespace: str | None = None, storage: str = "100Gi",
             storage_class: str | None = None, pvc: str | None = None, backoff_limit: int = 3) -> list[dict]:
    """The ConfigMap, the PersistentVolumeClaim (unless `pvc` names one) and the PyTorchJob, as objects."""
    cfg = job.cfg.model_copy(deep=True)
    cfg.logging.out_dir = f"{RUNS_DIR}/{name}"  # on the claim: every pod, every restart sees it
    cfg.checkpoint.dir = None
    recipe = ClusterJob(cfg, job.nodes, job.per_node, job.gpus, job.grace_s).recipe_toml()
    meta = {"name": name, **({"namespace": namespace} if namespace else {}), "labels": {"app.kubernetes.io/name":
                                                                                         "tessel"}}
    claim = pvc or f"{name}-runs"
    objects = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**meta, "name": f"{name}-recipe"},
                "data": {"recipe.toml": recipe}}]
    if pvc is None:
        spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": storage}}}
        if storage_class:
            spec["storageClassName"] = storage_class
        objects.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {**meta, "name": claim},
                        "spec": spec})
    pod = _pod_template(job, name, image, claim)
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod}}
    if job.nodes > 1:
        replicas["Worker"] = {"replicas": job.nodes - 1, "restartPolicy": "OnFailure", "template": pod}
    objects.append({"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": meta, "spec": {
        "nprocPerNode": str(job.per_node),
        "runPolicy": {"backoffLimit": backoff_limit, "cleanPodPolicy": "None"},
        "pytorchReplicaSpecs": replicas}})
    return objects


def _pod_template(job: ClusterJob, name: str, image: str, claim: str) -> dict:
    command = torchrun_argv(job, f"{RECIPE_DIR}/recipe.toml", "$(MASTER_ADDR):$(MASTER_PORT)", name, python="python")
    container = {
        "name": "pytorch",  # the operator looks for this name (its env, its port)
        "image": image,
        "command": command,
        "env": [{"name": "OMP_NUM_THREADS", "value": str(job.cfg.runtime.threads_per_rank)}],
        "ports": [{"name": "pytorchjob-port", "containerPort": PORT}],
        "volumeMounts": [{"name": "recipe", "mountPath": RECIPE_DIR, "readOnly": True},
                         {"name": "runs", "mountPath": RUNS_DIR},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if job.gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": job.per_node}}
    return {"spec": {
        "terminationGracePeriodSeconds": job.grace_s,  # SIGTERM to SIGKILL: time to save
        "containers": [container],
        "volumes": [{"name": "recipe", "configMap": {"name": f"{name}-recipe"}},
                    {"name": "runs", "persistentVolumeClaim": {"claimName": claim}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the recipe) as literal blocks, readable as the file they are; no anchors (the
    Master's and the Workers' pod templates are written out each)."""

    def ignore_aliases(self, data) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_Dumper.add_representer(str, _str)


def to_yaml(objects: list[dict]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
