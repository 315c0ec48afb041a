"""The campaign spec: one pydantic model (YAML), every section and field described; reading spec files and the built-in
examples."""
