"""What a worker's main process runs: the fair dispatcher that cuts the online and offline queues into batches, and the autoscaler."""
