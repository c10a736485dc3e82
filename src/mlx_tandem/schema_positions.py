"""Where a JSON Schema holds subschemas (draft 2020-12 and draft 7).

Everything else, ``const``, ``enum``, ``default`` and ``examples`` above all, is data: a
value that has a "properties" key is not an object schema. Walks over a schema
(schema_prep.py's preparation, marker_free.py) visit these positions only.
"""

SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SUBSCHEMA = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
             "contains", "propertyNames", "not", "if", "then", "else")
