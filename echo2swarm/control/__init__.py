"""Control plane: capacity model, cost-aware activation, telemetry (pure logic, used by the learner and `plan`)."""
