"""Dataplanes turn a full NodeState into kernel state. They never read Kubernetes
objects; every semantic was decided by the compiler."""
