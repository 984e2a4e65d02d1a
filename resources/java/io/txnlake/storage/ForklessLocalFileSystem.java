package io.txnlake.storage;

import java.io.IOException;
import java.net.URI;
import java.net.URISyntaxException;
import java.nio.file.Files;
import java.nio.file.attribute.PosixFilePermissions;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.ChecksumFs;
import org.apache.hadoop.fs.DelegateToFileSystem;
import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.FsConstants;
import org.apache.hadoop.fs.FsServerDefaults;
import org.apache.hadoop.fs.LocalFileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.local.LocalConfigKeys;
import org.apache.hadoop.fs.permission.FsPermission;

/**
 * Hadoop's local file system ({@code file:}) without a child process per call. Without Hadoop's
 * native library (pyspark ships none) {@code RawLocalFileSystem} runs {@code chmod} for every
 * permission it sets (every file and folder Spark and Delta create) and {@code readlink} for every
 * link status it reads (on every rename: each Delta commit). Here both are {@code java.nio} calls;
 * everything else, the checksum files included, is Hadoop's own. Symbolic links, sticky bits and
 * file systems without POSIX permissions keep Hadoop's code.
 */
public class ForklessLocalFileSystem extends LocalFileSystem {
    public ForklessLocalFileSystem() {
        super(new Raw());
    }

    /** The raw file system under the checksums: the two calls that started processes. */
    public static class Raw extends RawLocalFileSystem {
        @Override
        public void setPermission(Path p, FsPermission permission) throws IOException {
            if (permission.getStickyBit()) {
                super.setPermission(p, permission);
                return;
            }
            try {
                Files.setPosixFilePermissions(pathToFile(p).toPath(), PosixFilePermissions.fromString(
                    permission.getUserAction().SYMBOL + permission.getGroupAction().SYMBOL + permission.getOtherAction().SYMBOL));
            } catch (UnsupportedOperationException notPosix) {
                super.setPermission(p, permission);
            }
        }

        @Override
        public FileStatus getFileLinkStatus(Path f) throws IOException {
            // Not a link (or absent): Hadoop's answer is the file's status, or FileNotFoundException.
            if (!Files.isSymbolicLink(pathToFile(f).toPath())) {
                return getFileStatus(f);
            }
            return super.getFileLinkStatus(f);
        }
    }

    /** The same for {@code FileContext} (Delta's commits on a local path), as Hadoop's {@code LocalFs}. */
    public static class Fs extends ChecksumFs {
        public Fs(URI uri, Configuration conf) throws IOException, URISyntaxException {
            super(new RawFs(uri, conf));
        }
    }

    /** Hadoop's {@code RawLocalFs} over {@link Raw}. */
    public static class RawFs extends DelegateToFileSystem {
        public RawFs(URI uri, Configuration conf) throws IOException, URISyntaxException {
            super(uri, new Raw(), conf, FsConstants.LOCAL_FS_URI.getScheme(), false);
        }

        @Override
        public int getUriDefaultPort() {
            return -1;
        }

        @Override
        public FsServerDefaults getServerDefaults(Path f) throws IOException {
            return LocalConfigKeys.getServerDefaults();
        }

        @Override
        @SuppressWarnings("deprecation")
        public FsServerDefaults getServerDefaults() throws IOException {
            return LocalConfigKeys.getServerDefaults();
        }

        @Override
        public boolean isValidName(String src) {
            return true;
        }
    }
}
