"""Records -> pandas -> markdown tables and PNG plots; pure functions of the records."""
