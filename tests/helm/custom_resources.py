"""Required fields of the custom resources the chart renders (no CRD schemas ship with
kubernetes-validate): the parts KubeRay and the Prometheus Operator refuse objects without."""
from __future__ import annotations

OBJECT = {"type": "object"}
NAMED = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}}}
POD_TEMPLATE = {
    "type": "object", "required": ["spec"],
    "properties": {"spec": {"type": "object", "required": ["containers"],
                            "properties": {"containers": {"type": "array", "minItems": 1, "items": NAMED}}}},
}
SELECTOR = {"type": "object", "anyOf": [{"required": ["matchLabels"]}, {"required": ["matchExpressions"]}]}
ENDPOINT = {"type": "object", "required": ["port"]}


def _kind(spec: dict) -> dict:
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"metadata": NAMED, "spec": spec}}


SCHEMAS = {
    ("ray.io/v1", "RayCluster"): _kind({
        "type": "object", "required": ["headGroupSpec"],
        "properties": {
            "headGroupSpec": {"type": "object", "required": ["rayStartParams", "template"],
                              "properties": {"rayStartParams": {"type": "object",
                                                                "additionalProperties": {"type": "string"}},
                                             "template": POD_TEMPLATE}},
            "workerGroupSpecs": {"type": "array", "items": {
                "type": "object", "required": ["groupName", "replicas", "rayStartParams", "template"],
                "properties": {"groupName": {"type": "string", "minLength": 1},
                               "replicas": {"type": "integer", "minimum": 0},
                               "minReplicas": {"type": "integer", "minimum": 0},
                               "maxReplicas": {"type": "integer", "minimum": 0},
                               "rayStartParams": {"type": "object", "additionalProperties": {"type": "string"}},
                               "template": POD_TEMPLATE}}},
        }}),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _kind({
        "type": "object", "required": ["selector", "endpoints"],
        "properties": {"selector": SELECTOR, "endpoints": {"type": "array", "minItems": 1, "items": ENDPOINT}}}),
    ("monitoring.coreos.com/v1", "PodMonitor"): _kind({
        "type": "object", "required": ["selector", "podMetricsEndpoints"],
        "properties": {"selector": SELECTOR,
                       "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": ENDPOINT}}}),
    ("cert-manager.io/v1", "Certificate"): _kind({
        "type": "object", "required": ["secretName", "issuerRef"],
        "anyOf": [{"required": ["dnsNames"]}, {"required": ["commonName"]}],
        "properties": {"secretName": {"type": "string", "minLength": 1},
                       "dnsNames": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                       "issuerRef": {"type": "object", "required": ["name"],
                                     "properties": {"name": {"type": "string", "minLength": 1},
                                                    "kind": {"enum": ["Issuer", "ClusterIssuer"]}}},
                       "usages": {"type": "array", "items": {"type": "string"}},
                       "privateKey": {"type": "object", "properties": {
                           "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                           "rotationPolicy": {"enum": ["Never", "Always"]}}}}}),
    ("monitoring.coreos.com/v1", "PrometheusRule"): _kind({
        "type": "object", "required": ["groups"],
        "properties": {"groups": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "rules"],
            "properties": {"rules": {"type": "array", "items": {
                "type": "object", "required": ["expr"],
                "oneOf": [{"required": ["alert"]}, {"required": ["record"]}]}}}}}}}),
}
