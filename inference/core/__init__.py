"""Torch-free code every process shares: the models file, task shapes, Redis keys, queues, replies, the worker registry."""
