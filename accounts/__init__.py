"""Tenants' credentials and consumption: API keys with scopes, usage metering, quotas and rates."""
