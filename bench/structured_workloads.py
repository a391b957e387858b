"""The schemas of bench/structured.py: an order (nested object, bounded array, patterned
strings, a number range), enums with anyOf, and a structure-heavy configuration whose long
fixed keys leave the model only booleans and digits to choose; each with one valid instance
for walking a grammar token by token."""
from __future__ import annotations

OBJ = {"type": "object", "additionalProperties": False}
_BOOL, _DIGIT = {"type": "boolean"}, {"type": "integer", "minimum": 1, "maximum": 9}
HEAVY = {**OBJ, "required": ["service_deployment_environment", "enable_structured_request_logging",
                             "maximum_concurrent_client_connections", "primary_database_settings",
                             "experimental_feature_flags"], "properties": {
    "service_deployment_environment": {"enum": ["production-eu-west"]},
    "enable_structured_request_logging": _BOOL,
    "maximum_concurrent_client_connections": _DIGIT,
    "primary_database_settings": {**OBJ, "required": [
        "connection_pool_minimum_size", "connection_pool_maximum_size",
        "use_transport_layer_security", "statement_timeout_in_seconds"], "properties": {
        "connection_pool_minimum_size": _DIGIT, "connection_pool_maximum_size": _DIGIT,
        "use_transport_layer_security": _BOOL, "statement_timeout_in_seconds": _DIGIT}},
    "experimental_feature_flags": {**OBJ, "required": [
        "enable_speculative_prefetching", "enable_adaptive_batch_scheduling",
        "enable_compressed_key_value_cache"], "properties": {
        "enable_speculative_prefetching": _BOOL, "enable_adaptive_batch_scheduling": _BOOL,
        "enable_compressed_key_value_cache": _BOOL}}}}
ORDER = {**OBJ, "required": ["customer", "items", "total", "express"], "properties": {
    "customer": {**OBJ, "required": ["name", "city"], "properties": {
        "name": {"type": "string", "maxLength": 16}, "city": {"type": "string", "maxLength": 16}}},
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        **OBJ, "required": ["sku", "qty"], "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 20}}}},
    "total": {"type": "number", "minimum": 0, "maximum": 1000},
    "express": {"type": "boolean"}}}
ENUMS = {**OBJ, "required": ["color", "size", "mood"], "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]},
    "mood": {"anyOf": [{"enum": ["happy", "sad"]}, {"type": "null"}]}}}
# each schema with one valid instance, laid out as the engine's JSON options lay it out
SCHEMAS = {
    "order": (ORDER, {"customer": {"name": "Ada", "city": "Paris"},
                      "items": [{"sku": "AB-123", "qty": 2}, {"sku": "CD-456", "qty": 1}],
                      "total": 42.5, "express": True}),
    "enums": (ENUMS, {"color": "green", "size": "XL", "mood": None}),
    "heavy": (HEAVY, {"service_deployment_environment": "production-eu-west",
                      "enable_structured_request_logging": True,
                      "maximum_concurrent_client_connections": 8,
                      "primary_database_settings": {
                          "connection_pool_minimum_size": 2, "connection_pool_maximum_size": 8,
                          "use_transport_layer_security": True,
                          "statement_timeout_in_seconds": 5},
                      "experimental_feature_flags": {
                          "enable_speculative_prefetching": False,
                          "enable_adaptive_batch_scheduling": True,
                          "enable_compressed_key_value_cache": False}}),
}
