"""The Ray worker runtime around one engine: the actor, its engine loop, the
directory client, the cache mirror and chunk handling."""
