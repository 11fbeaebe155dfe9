"""Running calls: worker processes on RQ, the call state machine, policy, retries/breakers, executors."""
