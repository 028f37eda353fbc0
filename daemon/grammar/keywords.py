"""The JSON Schema vocabulary, keyword by keyword: what describes nothing, what
each type may carry, what combines schemas, and what no grammar can enforce.

schema_walk.py refuses any keyword outside these sets, so a new keyword is
refused until it is placed in one of them.
"""

# Keywords that describe and constrain nothing.
ANNOTATIONS = frozenset({
    "title", "description", "examples", "example", "default", "$schema", "$comment", "deprecated",
    "readOnly", "writeOnly", "$anchor", "$vocabulary", "discriminator", "$id",
})
CONTAINERS = frozenset({"$defs", "definitions"})  # hold schemas reached through $ref
STRING_KEYWORDS = frozenset({"pattern", "format", "minLength", "maxLength", "contentEncoding",
                             "contentMediaType", "contentSchema"})
RANGE_KEYWORDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
NUMBER_KEYWORDS = frozenset({*RANGE_KEYWORDS, "multipleOf"})
OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties", "minProperties", "maxProperties",
                             "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas",
                             "dependencies", "unevaluatedProperties"})
ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
                            "contains", "minContains", "maxContains", "unevaluatedItems"})
VOCABULARY = {"string": STRING_KEYWORDS, "number": NUMBER_KEYWORDS, "integer": NUMBER_KEYWORDS,
              "object": OBJECT_KEYWORDS, "array": ARRAY_KEYWORDS, "boolean": frozenset(), "null": frozenset()}
COMBINATORS = frozenset({"$ref", "allOf", "anyOf", "oneOf"})
VALUE_KEYWORDS = frozenset({"const", "enum", "type"})
# Known, but a grammar cannot enforce them (or the converter ignores them).
UNSUPPORTED = frozenset({"not", "if", "then", "else", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
                         "$recursiveAnchor"})
TYPES = tuple(VOCABULARY)
ANY_VALUE_TYPES = ["object", "array", "string", "number", "boolean", "null"]  # integer is a number
FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"})
