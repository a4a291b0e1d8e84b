"""The Runtime facade, the model registry, the supervisor, the sync facade and metrics. May import
actors and everything below them; never api."""
