{{/*
The operator's permissions, least privilege: exactly the list in docs/operator.md ("RBAC"), which
tests/unit/test_chart_rbac.py compares these rules with. Nothing deletes but replica StatefulSets (the
garbage collector removes children through their owner references; a BlueGreen rollout retires a replica
set while its owner lives) and an InferencePool no longer asked for, nothing reads Secrets (the HF token is a secretKeyRef the
kubelet resolves), no kopf peering objects (the operator runs standalone).
*/}}

{{/* Framework rules: what kopf itself needs. Cluster-scoped, so always a ClusterRole. */}}
{{- define "mooncake-operator.frameworkRules" -}}
# kopf's resource scanning: it discovers the MooncakeServing CRD and notices it change.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
# kopf's namespace observation (it falls back, with a warning, without it).
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}

{{/* Leader election: the release's Lease in the release namespace (`create` cannot be limited to a name). */}}
{{- define "mooncake-operator.leaderRules" -}}
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["create"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  resourceNames: [{{ include "mooncake-operator.leaseName" . | quote }}]
  verbs: ["get", "patch"]
{{- end }}

{{/* Application rules: what the reconcile does. A ClusterRole for a cluster-wide watch, else a Role
in each watched namespace. `create` next to `patch`: a server-side apply that creates an object is
authorized as a create. */}}
{{- define "mooncake-operator.applicationRules" -}}
# The custom resource: kopf watches it (no handler needs a finalizer, so kopf never patches it); the
# reconcile reads it from the API server only after a conflict (or before the watch has delivered it).
- apiGroups: ["serving.mooncake-operator.dev"]
  resources: ["mooncakeservings"]
  verbs: ["get", "list", "watch"]
# Phase, conditions and canary evidence.
- apiGroups: ["serving.mooncake-operator.dev"]
  resources: ["mooncakeservings/status"]
  verbs: ["patch"]
# Children, applied server-side: the store config and NAME-last-good ConfigMaps, the master, headless
# and client Services, the master Deployment and the replica StatefulSet, the replicas'
# PodDisruptionBudget and the master's and replicas' NetworkPolicies. Read only through the watch cache
# (list + watch, selected by the managed-by label); no single GETs.
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["list", "watch", "create", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments", "statefulsets"]
  verbs: ["list", "watch", "create", "patch"]
# BlueGreen rollouts: the old replica set after the switch, a candidate that failed (Rollback) or that
# the spec no longer asks for. RBAC cannot narrow a delete to the replica sets; the operator deletes only
# StatefulSets its watch cache holds as its own replica sets.
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["list", "watch", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["list", "watch", "create", "patch"]
# spec.inferencePool: the InferencePool (Gateway API Inference Extension), applied and watched once the
# API server serves it; deleted when spec.inferencePool is unset (only the resource's own pool).
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["list", "watch", "create", "patch", "delete"]
# Replica and master pods (watched): readiness, pod UIDs and restarts (canary triggers), and the
# traffic label that takes a replica out of the client Service when the canary blames it.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "patch"]
# An event on every phase transition.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
