"""Expert parallelism: tokens dispatched to their experts' ranks and combined back."""
