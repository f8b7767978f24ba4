"""Where a multi-node job's state lives (issue 26): the coordination store's interface (store) and the store that
worker-0's runtime hosts, server and client (embedded). The launch barrier and the job-wide restart are built on
it; this package knows nothing of them."""
