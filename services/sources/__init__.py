"""The sources service: keeps KBs in sync with git repositories and web sites, on a schedule
and on push, by publishing their documents as an upstream system would."""
