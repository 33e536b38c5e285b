"""Pipeline parallelism: schedules (pure logic) and the runtime that executes them."""
