/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cgroup socket hooks: load balancing at connect()/sendmsg() for the node's own
 * processes and the pods' (lib/sock.h). The agent attaches them to a cgroup
 * (agent/dataplane/ebpf/cgroup.py); they act on sockets of the node's network namespace
 * and of the pod namespaces listed in kbp_pods, as --socket-lb says.
 */
#include "lib/common.h"
#include "lib/sock.h"

/* connect(): TCP and connected UDP. */
int kbp_connect4(struct bpf_sock_addr *ctx)
{
	return sock4_to_backend(ctx, 1);
}

int kbp_connect6(struct bpf_sock_addr *ctx)
{
	return sock6_to_backend(ctx, 1);
}

/* sendmsg()/sendto() with an address on an unconnected UDP socket. */
int kbp_sendmsg4(struct bpf_sock_addr *ctx)
{
	return sock4_to_backend(ctx, 0);
}

int kbp_sendmsg6(struct bpf_sock_addr *ctx)
{
	return sock6_to_backend(ctx, 0);
}

/* recvmsg()/recvfrom() of UDP: the source address of the datagram. */
int kbp_recvmsg4(struct bpf_sock_addr *ctx)
{
	return sock4_to_frontend(ctx);
}

int kbp_recvmsg6(struct bpf_sock_addr *ctx)
{
	return sock6_to_frontend(ctx);
}

/* getpeername(). */
int kbp_peername4(struct bpf_sock_addr *ctx)
{
	return sock4_to_frontend(ctx);
}

int kbp_peername6(struct bpf_sock_addr *ctx)
{
	return sock6_to_frontend(ctx);
}

/* The socket is being closed. */
int kbp_release(struct bpf_sock *ctx)
{
	return sock_forget(ctx);
}
