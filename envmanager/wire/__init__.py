"""What crosses the process line: typed messages (``messages``), the shared step queue
(``step_queue``) and the shared-memory arrays (``shm``)."""
