"""What a worker pool child runs: the loaded models (handlers), running batches through them, answering callers."""
