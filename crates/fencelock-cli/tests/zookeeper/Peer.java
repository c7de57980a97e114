// A Curator client driven line by line on stdin, the interop peer of the ZooKeeper tests.
// Usage: java Peer CONNECT_STRING. Commands, one per line:
//   lock ID PATH     take InterProcessMutex(PATH) in a thread of its own, then print "granted ID"
//   release ID       release the mutex taken as ID (from its own thread, as Curator requires)
//   try PATH         print "try true" if acquire(1, SECONDS) succeeds (then release), else "try false"
//   leader PATH      print "leader ID", the participant LeaderLatch(PATH) reports as leader
//   children PATH    print "children N", the number of children of PATH (0 if none)
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.leader.LeaderLatch;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.retry.RetryNTimes;
import org.apache.zookeeper.KeeperException;

public class Peer {
    static final Map<String, CountDownLatch> releases = new ConcurrentHashMap<>();

    static synchronized void say(String s) {
        System.out.println(s);
        System.out.flush();
    }

    public static void main(String[] args) throws Exception {
        CuratorFramework c = CuratorFrameworkFactory.builder()
            .connectString(args[0])
            .sessionTimeoutMs(4000)
            .connectionTimeoutMs(4000)
            .retryPolicy(new RetryNTimes(20, 100))
            .build();
        c.start();
        c.blockUntilConnected();
        say("ready");
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        String line;
        while ((line = in.readLine()) != null) {
            String[] w = line.trim().split(" ");
            try {
                switch (w[0]) {
                    case "lock": {
                        String id = w[1];
                        String path = w[2];
                        CountDownLatch rel = new CountDownLatch(1);
                        releases.put(id, rel);
                        new Thread(() -> {
                            try {
                                InterProcessMutex m = new InterProcessMutex(c, path);
                                m.acquire();
                                say("granted " + id);
                                rel.await();
                                m.release();
                                say("released " + id);
                            } catch (Exception e) {
                                say("error " + id + " " + e);
                            }
                        }).start();
                        break;
                    }
                    case "release":
                        releases.remove(w[1]).countDown();
                        break;
                    case "try": {
                        InterProcessMutex m = new InterProcessMutex(c, w[1]);
                        boolean got = m.acquire(1, TimeUnit.SECONDS);
                        if (got) {
                            m.release();
                        }
                        say("try " + got);
                        break;
                    }
                    case "leader":
                        say("leader " + new LeaderLatch(c, w[1]).getLeader().getId());
                        break;
                    case "children": {
                        // The lock path is a container, which the server deletes within a
                        // second of its last child: gone before or while it is read, it has
                        // no children.
                        int n;
                        try {
                            n = c.getChildren().forPath(w[1]).size();
                        } catch (KeeperException.NoNodeException e) {
                            n = 0;
                        }
                        say("children " + n);
                        break;
                    }
                    default:
                        say("error unknown command " + w[0]);
                }
            } catch (Exception e) {
                say("error " + e);
            }
        }
        c.close();
    }
}
