"""The schema `tessel launch k8s` manifests are validated against, offline: pydantic models of the fields.

Written from the public definitions (read, not copied):
- the PyTorchJob CRD of Kubeflow's Training Operator, kubeflow.org/v1
  (kubeflow/training-operator, manifests/base/crds/kubeflow.org_pytorchjobs.yaml:
  spec.pytorchReplicaSpecs required, a map of replica type to {replicas int32,
  restartPolicy, template: a core/v1 PodTemplateSpec}; spec.nprocPerNode a
  string; spec.runPolicy {backoffLimit int32, cleanPodPolicy, ...}) and the
  rules its admission webhook adds (pkg/webhooks/pytorch/pytorchjob_webhook.go:
  the name a DNS-1035 label; replica types Master and Worker; Master has exactly
  1 replica, Worker at least 1; every container has an image; one is named
  "pytorch"); the enums are those of pkg/apis/kubeflow.org/v1 (RestartPolicy,
  CleanPodPolicy);
- Kubernetes core/v1 (ConfigMap, PersistentVolumeClaim, and the parts of
  PodSpec, Container, Volume and VolumeMount the manifest uses), as in the
  Kubernetes API reference.

Only the fields tessel writes are modelled, with extra="forbid": a field the
real schema has and these models lack fails the test, as `kubectl apply
--validate=strict` would fail an unknown field; a model is widened by adding
the field as the API reference defines it.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

DNS_1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# resource.Quantity as the CRD's pattern spells it (an int-or-string)
QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+"
                      r"(\.[0-9]*)?)|(\.[0-9]+))))?$")
Int32 = Annotated[int, Field(ge=-2**31, lt=2**31)]
Name = Annotated[str, StringConstraints(pattern=DNS_1123_SUBDOMAIN, max_length=253)]
Label = Annotated[str, StringConstraints(pattern=DNS_1123_LABEL, max_length=63)]


class K8s(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _quantity(value: int | str) -> int | str:
    if isinstance(value, str) and not QUANTITY.match(value):
        raise ValueError(f"'{value}' is not a quantity")
    return value


class ObjectMeta(K8s):
    name: Name
    namespace: Label | None = None
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}


class ConfigMap(K8s):
    apiVersion: Literal["v1"]
    kind: Literal["ConfigMap"]
    metadata: ObjectMeta
    data: dict[str, str]


class ResourceRequirements(K8s):
    limits: dict[str, int | str] = {}
    requests: dict[str, int | str] = {}

    @field_validator("limits", "requests")
    @classmethod
    def _quantities(cls, v: dict) -> dict:
        return {k: _quantity(q) for k, q in v.items()}


class PersistentVolumeClaimSpec(K8s):
    accessModes: list[Literal["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]]
    resources: ResourceRequirements
    storageClassName: str | None = None


class PersistentVolumeClaim(K8s):
    apiVersion: Literal["v1"]
    kind: Literal["PersistentVolumeClaim"]
    metadata: ObjectMeta
    spec: PersistentVolumeClaimSpec


class EnvVar(K8s):
    name: str
    value: str | None = None


class ContainerPort(K8s):
    containerPort: Int32 = Field(gt=0, lt=65536)
    name: Label | None = None
    protocol: Literal["TCP", "UDP", "SCTP"] | None = None


class VolumeMount(K8s):
    name: str
    mountPath: str
    readOnly: bool | None = None
    subPath: str | None = None


class Container(K8s):
    name: Label
    image: str = Field(min_length=1)  # the webhook: "must be required"
    command: list[str] = []
    args: list[str] = []
    env: list[EnvVar] = []
    ports: list[ContainerPort] = []
    resources: ResourceRequirements | None = None
    volumeMounts: list[VolumeMount] = []
    workingDir: str | None = None


class ConfigMapVolumeSource(K8s):
    name: Name


class PVCVolumeSource(K8s):
    claimName: Name
    readOnly: bool | None = None


class EmptyDirVolumeSource(K8s):
    medium: Literal["", "Memory"] | None = None
    sizeLimit: int | str | None = None


class Volume(K8s):
    name: Label
    configMap: ConfigMapVolumeSource | None = None
    persistentVolumeClaim: PVCVolumeSource | None = None
    emptyDir: EmptyDirVolumeSource | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "Volume":
        if sum(s is not None for s in (self.configMap, self.persistentVolumeClaim, self.emptyDir)) != 1:
            raise ValueError(f"volume {self.name} needs exactly one source")
        return self


class PodSpec(K8s):
    containers: list[Container] = Field(min_length=1)
    volumes: list[Volume] = []
    terminationGracePeriodSeconds: int | None = Field(None, ge=0)
    restartPolicy: Literal["Always", "OnFailure", "Never"] | None = None

    @model_validator(mode="after")
    def _mounts_name_volumes(self) -> "PodSpec":
        names = {v.name for v in self.volumes}
        for c in self.containers:
            for m in c.volumeMounts:
                if m.name not in names:
                    raise ValueError(f"container {c.name} mounts {m.name}, which is no volume of the pod")
        return self


class PodTemplateSpec(K8s):
    metadata: dict | None = None
    spec: PodSpec


class ReplicaSpec(K8s):
    replicas: Int32 | None = None
    restartPolicy: Literal["Always", "OnFailure", "Never", "ExitCode"] | None = None
    template: PodTemplateSpec

    @model_validator(mode="after")
    def _pytorch_container(self) -> "ReplicaSpec":
        if not any(c.name == "pytorch" for c in self.template.spec.containers):
            raise ValueError("must have at least one container with name pytorch")
        return self


class RunPolicy(K8s):
    backoffLimit: Int32 | None = None
    cleanPodPolicy: Literal["All", "Running", "None"] | None = None
    activeDeadlineSeconds: int | None = None
    ttlSecondsAfterFinished: Int32 | None = None
    suspend: bool | None = None


class PyTorchJobSpec(K8s):
    pytorchReplicaSpecs: dict[Literal["Master", "Worker"], ReplicaSpec]
    nprocPerNode: str | None = None
    runPolicy: RunPolicy | None = None

    @model_validator(mode="after")
    def _replicas(self) -> "PyTorchJobSpec":
        master = self.pytorchReplicaSpecs.get("Master")
        if master is not None and master.replicas != 1:
            raise ValueError("Master replicas must be 1")
        worker = self.pytorchReplicaSpecs.get("Worker")
        if worker is not None and worker.replicas is not None and worker.replicas < 1:
            raise ValueError("Worker replicas must be at least 1")
        return self


class PyTorchJobMeta(ObjectMeta):
    name: Annotated[str, StringConstraints(pattern=DNS_1035_LABEL, max_length=63)]


class PyTorchJob(K8s):
    apiVersion: Literal["kubeflow.org/v1"]
    kind: Literal["PyTorchJob"]
    metadata: PyTorchJobMeta
    spec: PyTorchJobSpec


KINDS = {"ConfigMap": ConfigMap, "PersistentVolumeClaim": PersistentVolumeClaim, "PyTorchJob": PyTorchJob}


def validate(doc: dict) -> BaseModel:
    """The object as its kind's model; pydantic.ValidationError where it breaks the schema."""
    return KINDS[doc["kind"]].model_validate(doc)
