//! The kernel's sock_diag interface in one network namespace: list the inet sockets
//! of a protocol, and destroy one (`SOCK_DESTROY`, what `ss -K` sends).

use std::net::SocketAddr;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NetlinkSerializable, NLM_F_ACK, NLM_F_DUMP,
    NLM_F_REQUEST,
};
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6};
use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
use netlink_packet_sock_diag::{SockDiagDestroy, SockDiagMessage};
use netlink_sys::{protocols::NETLINK_SOCK_DIAG, Socket, SocketAddr as NetlinkAddr};

use crate::model::Protocol;

#[derive(Debug, thiserror::Error)]
pub enum DiagError {
    #[error("sock_diag {op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("sock_diag {op}: unreadable answer: {detail}")]
    Decode { op: &'static str, detail: String },
}

/// One socket as a dump lists it.
#[derive(Clone, Debug)]
pub struct Listed {
    pub family: u8,
    pub id: SocketId,
}

impl Listed {
    /// The socket's cookie (`bpf_get_socket_cookie`): the kernel splits it into two
    /// native-endian 32-bit words, low word first.
    pub fn cookie(&self) -> u64 {
        let word = |i: usize| {
            u64::from(u32::from_ne_bytes(
                self.id.cookie[i * 4..i * 4 + 4]
                    .try_into()
                    .expect("4 bytes"),
            ))
        };
        word(0) | word(1) << 32
    }

    /// The socket's peer; IPv4-mapped peers of AF_INET6 sockets as IPv4.
    pub fn peer(&self) -> SocketAddr {
        SocketAddr::new(
            self.id.destination_address.to_canonical(),
            self.id.destination_port,
        )
    }
}

/// A sock_diag socket, bound to the network namespace it was opened in.
pub struct Diag {
    socket: Socket,
    buf: Vec<u8>,
}

/// Both families: IPv4 peers of dual-stack sockets are listed under AF_INET6.
pub const FAMILIES: [u8; 2] = [AF_INET, AF_INET6];

impl Diag {
    pub fn open() -> Result<Self, DiagError> {
        let io = |op| move |source| DiagError::Io { op, source };
        let mut socket = Socket::new(NETLINK_SOCK_DIAG).map_err(io("socket"))?;
        socket.bind_auto().map_err(io("bind"))?;
        socket
            .connect(&NetlinkAddr::new(0, 0))
            .map_err(io("connect"))?;
        Ok(Diag {
            socket,
            buf: vec![0; 64 * 1024],
        })
    }

    /// Every socket of `protocol` in `family` (all states).
    pub fn list(&mut self, family: u8, protocol: Protocol) -> Result<Vec<Listed>, DiagError> {
        let request = SockDiagMessage::InetRequest(request(family, protocol, any_socket(family)));
        self.send("dump", request, NLM_F_REQUEST | NLM_F_DUMP)?;
        let mut listed = Vec::new();
        loop {
            let mut done = false;
            self.receive("dump", |payload| match payload {
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(response)) => {
                    listed.push(Listed {
                        family: response.header.family,
                        id: response.header.socket_id,
                    });
                    Ok(())
                }
                NetlinkPayload::Done(_) => {
                    done = true;
                    Ok(())
                }
                NetlinkPayload::Error(e) => Err(e.to_io()),
                _ => Ok(()),
            })?;
            if done {
                return Ok(listed);
            }
        }
    }

    /// Destroys `socket` (matched by its addresses and cookie): a call blocked on it
    /// fails with ECONNABORTED; a TCP peer gets a RST. The kernel's errno on
    /// failure: ENOENT when the socket is gone, EOPNOTSUPP without
    /// CONFIG_INET_DIAG_DESTROY.
    pub fn destroy(&mut self, protocol: Protocol, socket: &Listed) -> Result<(), DiagError> {
        let request = SockDiagDestroy::new(SockDiagMessage::InetRequest(request(
            socket.family,
            protocol,
            socket.id.clone(),
        )));
        self.send("destroy", request, NLM_F_REQUEST | NLM_F_ACK)?;
        let mut acked = None;
        while acked.is_none() {
            self.receive("destroy", |payload| {
                if let NetlinkPayload::Error(e) = payload {
                    acked = Some(match e.code {
                        None => Ok(()),
                        Some(_) => Err(e.to_io()),
                    });
                }
                Ok(())
            })?;
        }
        acked
            .expect("loop ends on the ack")
            .map_err(|source| DiagError::Io {
                op: "destroy",
                source,
            })
    }

    fn send<T: NetlinkSerializable>(
        &mut self,
        op: &'static str,
        message: T,
        flags: u16,
    ) -> Result<(), DiagError>
    where
        NetlinkPayload<T>: From<T>,
    {
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        let mut packet = NetlinkMessage::new(header, message.into());
        packet.finalize();
        let mut bytes = vec![0; packet.buffer_len()];
        packet.serialize(&mut bytes);
        self.socket
            .send(&bytes, 0)
            .map(drop)
            .map_err(|source| DiagError::Io { op, source })
    }

    /// Reads one datagram and hands each message in it to `each`.
    fn receive(
        &mut self,
        op: &'static str,
        mut each: impl FnMut(NetlinkPayload<SockDiagMessage>) -> std::io::Result<()>,
    ) -> Result<(), DiagError> {
        let size = self
            .socket
            .recv(&mut &mut self.buf[..], 0)
            .map_err(|source| DiagError::Io { op, source })?;
        let mut offset = 0;
        while offset < size {
            let message = NetlinkMessage::<SockDiagMessage>::deserialize(&self.buf[offset..size])
                .map_err(|e| DiagError::Decode {
                op,
                detail: e.to_string(),
            })?;
            let length = message.header.length as usize;
            each(message.payload).map_err(|source| DiagError::Io { op, source })?;
            if length == 0 {
                break;
            }
            offset += length;
        }
        Ok(())
    }
}

fn request(family: u8, protocol: Protocol, socket_id: SocketId) -> InetRequest {
    InetRequest {
        family,
        protocol: protocol.number(),
        extensions: ExtensionFlags::empty(),
        states: StateFlags::all(),
        socket_id,
    }
}

fn any_socket(family: u8) -> SocketId {
    if family == AF_INET6 {
        SocketId::new_v6()
    } else {
        SocketId::new_v4()
    }
}
