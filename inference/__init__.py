"""Online inference: model registry, runtime, batching, admission and the predict API."""
