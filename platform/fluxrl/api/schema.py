"""drf-spectacular hook: every operation documents the one error body of fluxrl.api.errors."""

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "fields"],
            "properties": {
                "code": {"type": "string", "example": "invalid"},
                "message": {"type": "string"},
                "fields": {"type": "object", "additionalProperties": {"type": "string"},
                           "description": "dotted field name -> what is wrong with it"},
            },
        }
    },
}
ERROR_STATUSES = {
    "400": "Invalid input", "401": "Missing, invalid, expired or revoked token", "403": "Not allowed (scope, role, run token)",
    "404": "Not found (or another team's)", "409": "Conflict (e.g. illegal run state transition)", "413": "Too large",
    "415": "Unsupported media type (a body the endpoint's parsers cannot read)",
}
# Declared only by the operations that can answer them (extend_schema); given the error body here.
OPTIONAL_ERROR_STATUSES = ("429", "501")


def add_error_responses(result, generator, request, public):
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    content = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for operations in result.get("paths", {}).values():
        for operation in operations.values():
            for status, description in ERROR_STATUSES.items():
                operation["responses"].setdefault(status, {"description": description, "content": content})
            for status in OPTIONAL_ERROR_STATUSES:
                if status in operation["responses"]:
                    operation["responses"][status].setdefault("content", content)
    return result
