import os

from radixserve.launch.listeners import adopt

server = adopt(int(os.environ["LISTEN_CHILD_FD"]))
line = f"{os.environ['LISTEN_CHILD_NAME']} {os.getpid()}\n".encode()
while True:
    conn, _ = server.accept()
    with conn:
        conn.sendall(line)
