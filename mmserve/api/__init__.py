"""HTTP: quart-trio routes, the OpenAI JSON mapping (one place) and the hypercorn server. Only maps
HTTP onto the Runtime API; may import runtime and everything below it."""
