"""Operations: the CLI, starting and stopping a cluster and its named actors, Ray
sessions, models on disk, status, and the interactive chat."""
