"""Tenants and money: keys, rate limits, budgets, fair share, prices, the ledger and the
economics."""
