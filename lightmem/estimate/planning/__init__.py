"""The planner's space (configurations, the walks through them, the search) and what it returns."""
