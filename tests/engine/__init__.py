"""Engine tests: scheduler, paging, prefix cache, sampling, validation."""
