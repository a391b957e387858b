"""A request's path on the gateway: its in-flight record, admission, the queue, dispatch and the
accounting."""
