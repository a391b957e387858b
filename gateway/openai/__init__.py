"""OpenAI's request and response shapes: parsing and validation, response and chunk objects."""
