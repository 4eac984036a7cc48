"""`tessel launch k8s`: the manifest passes the PyTorchJob and core/v1 schema (tests/commands/launchers/k8s_schema.py),
its pods run the job's torchrun on the operator's rendezvous variables, and docs/cluster.md shows it as written."""

import re
import shlex
import tomllib
from pathlib import Path

import pydantic
import pytest
import yaml

import tessel.commands.cli
from tessel.config import build_config
from tessel.commands.launchers.job import check_job
from tessel.commands.launchers.k8s import manifest, to_yaml
from tests.helpers import tiny_config
from tests.commands.launchers.k8s_schema import validate

CLUSTER_PAGE = Path(__file__).resolve().parents[3] / "docs" / "cluster.md"
ROOT = CLUSTER_PAGE.parents[1]
OPERATOR_ENV = {"MASTER_ADDR", "MASTER_PORT"}  # what the Training Operator sets in every pod (envvar.go)


def _objects(nodes: int, gpus: int | None, procs: int | None, **kw) -> tuple[list[dict], object]:
    per_node = gpus or procs
    job = check_job(tiny_config(f"parallel.dp={nodes * per_node}", "checkpoint.every=5", "train.global_batch=8"),
                    nodes, gpus, procs, grace_s=90)
    text = to_yaml(manifest(job, "tiny-run", "registry.example.com/tessel:0.1", **kw))
    return list(yaml.safe_load_all(text)), job  # through YAML, as kubectl reads it


@pytest.mark.parametrize("nodes,gpus,procs", [(2, 4, None), (4, None, 2), (1, 8, None)])
def test_manifest_passes_the_schema_and_runs_the_jobs_torchrun(nodes, gpus, procs):
    docs, job = _objects(nodes, gpus, procs, namespace="ml")
    models = [validate(d) for d in docs]
    assert [m.kind for m in models] == ["ConfigMap", "PersistentVolumeClaim", "PyTorchJob"]
    recipe, claim, pytorchjob = models
    replicas = pytorchjob.spec.pytorchReplicaSpecs
    assert sum(r.replicas for r in replicas.values()) == nodes and replicas["Master"].replicas == 1
    assert pytorchjob.spec.nprocPerNode == str(job.per_node)
    for spec in replicas.values():
        pod = spec.template.spec
        assert spec.restartPolicy == "OnFailure" and pod.terminationGracePeriodSeconds == 90
        (container,) = pod.containers
        command = container.command
        assert command[:3] == ["python", "-m", "torch.distributed.run"]
        assert f"--nnodes={nodes}" in command and f"--nproc-per-node={job.per_node}" in command
        assert "--rdzv-backend=c10d" in command and "--rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT)" in command
        assert command[command.index("train") + 1:] == ["/etc/tessel/recipe.toml", "--resume", "auto"]
        # every $(VAR) Kubernetes expands is set: by the operator, or by the container itself
        wanted = set(re.findall(r"\$\((\w+)\)", " ".join(command)))
        assert wanted <= OPERATOR_ENV | {e.name for e in container.env}
        assert [p.name for p in container.ports] == ["pytorchjob-port"]  # MASTER_PORT comes from it
        assert (container.resources.limits == {"nvidia.com/gpu": gpus}) if gpus else container.resources is None
        mounts = {m.mountPath: m.name for m in container.volumeMounts}
        volumes = {v.name: v for v in pod.volumes}
        assert volumes[mounts["/tessel/runs"]].persistentVolumeClaim.claimName == claim.metadata.name
        assert volumes[mounts["/etc/tessel"]].configMap.name == recipe.metadata.name
        assert volumes[mounts["/dev/shm"]].emptyDir.medium == "Memory"
    # the recipe the pods read is the job's, its run folder on the claim
    cfg = build_config(tomllib.loads(recipe.data["recipe.toml"]))
    assert cfg.parallel.world_size == nodes * job.per_node and cfg.runtime.nproc_per_node == job.per_node
    assert cfg.logging.out_dir == "/tessel/runs/tiny-run" and cfg.checkpoint.every == 5
    assert all(m.metadata.namespace == "ml" for m in models)


def test_an_existing_claim_is_used_and_the_schema_is_not_vacuous():
    docs, _ = _objects(2, None, 1, pvc="shared-runs")
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]
    pod = docs[1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["volumes"][1]["persistentVolumeClaim"]["claimName"] == "shared-runs"
    job = docs[1]

    def broken(edit) -> dict:
        doc = yaml.safe_load(yaml.safe_dump(job))
        edit(doc)
        return doc

    for edit in (lambda d: d["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas=2),
                 lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"].update(restartPolicy="Sometimes"),
                 lambda d: d["spec"]["pytorchReplicaSpecs"].update(Chief=d["spec"]["pytorchReplicaSpecs"]["Master"]),
                 lambda d: d["spec"]["runPolicy"].update(backofLimit=3),  # a misspelt field
                 lambda d: d["metadata"].update(name="Tiny_Run"),
                 lambda d: d["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0].update(
                     name="trainer"),  # the operator needs a container named pytorch
                 lambda d: d["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"].pop()):
        with pytest.raises(pydantic.ValidationError):
            validate(broken(edit))


def test_the_cluster_page_shows_the_manifest_the_command_writes(monkeypatch, capsys):
    text = CLUSTER_PAGE.read_text()
    found = re.search(r"```bash\n(tessel launch k8s [^\n]+)\n```\n\n[^`]*```yaml\n(.*?)```", text, re.S)
    assert found, "docs/cluster.md: no `tessel launch k8s` command followed by its manifest"
    monkeypatch.chdir(ROOT)  # the page's recipe path is the repository's
    with pytest.raises(SystemExit) as done:
        tessel.commands.cli.main(shlex.split(found.group(1))[1:])  # the command as written
    assert done.value.code == 0
    assert capsys.readouterr().out == found.group(2)
    assert all(validate(d) for d in yaml.safe_load_all(found.group(2)))
