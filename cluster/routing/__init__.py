"""Routing: a prompt's tokens and keys, the policy that picks a worker, the workers'
load as routers see it, and the router that streams from the chosen one."""
