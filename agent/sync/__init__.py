"""The sync loop: sources write a shared ClusterState, the loop compiles and applies."""
