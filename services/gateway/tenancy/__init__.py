"""Who may ask for what: API keys and tenants, and admission against their bounds."""
